"""Incremental text segmentation: streamed text (token by token) -> speakable segments.

A segment is what one engine turn speaks. Segments end

- at a sentence end in any script: ``. ! ? …`` (Latin and most alphabetic scripts, when
  followed by whitespace or by CJK text), ``。！？．｡`` (CJK, fullwidth), ``؟ ۔`` (Arabic,
  Urdu), ``। ॥`` (Devanagari and other Indic scripts), ``። ፧`` (Ethiopic), ``։`` (Armenian),
  ``။`` (Myanmar), ``།`` (Tibetan) and the like, together with any run of further
  terminators and closing quotes/brackets (``?!``, ``...``, ``。」``);
- at a line break;
- at ``chunk_length`` characters when no sentence end came first, on the last word boundary
  (whitespace or clause punctuation such as ``, ; : ， 、 ،``) before the limit; text without
  any boundary (a long run of CJK characters without punctuation) is cut at the limit itself,
  never inside a combining sequence;
- at ``flush``: whatever is buffered.

Every segment is at most ``chunk_length`` characters long (a sentence longer than that is cut
on length too), so the session can size ``chunk_length`` to what its context window holds.
Segments are stripped of surrounding whitespace; any other text, also punctuation or emoji
alone, becomes a segment (whitespace alone never does).

Streaming makes one thing subtle: when the buffer *ends* with a terminator, the next token
may still turn it into something else (``3.`` + ``14``, ``。`` + ``」``), so a boundary is only
taken once the character after it has arrived, or at ``flush``. Decimal numbers (``3.14``),
``e.g.``-style abbreviations and single-letter initials (``J. K.``) never end a sentence.

The buffer is bounded: after every ``push`` it holds at most ``chunk_length`` characters, so the
memory of a context is ``chunk_length`` plus the segments waiting to be spoken (which the
session bounds).

:func:`estimate_speech_seconds` guesses how long a segment takes to say, per script, for the
session's frame budget.
"""

from __future__ import annotations

import unicodedata
from typing import Final, NamedTuple

__all__ = ["Cut", "Segmenter", "estimate_speech_seconds", "is_speakable"]

# Terminators that end a sentence only before whitespace (or CJK text): "3.14", "e.g.x",
# "file.txt" and "Hello!World" stay whole.
_SPACED_ENDS: Final = frozenset(".!?")
# Terminators that end a sentence wherever they stand (scripts written without spaces after
# sentences, or whose marks are unambiguous).
_ANY_ENDS: Final = frozenset(
    "…‥"  # ellipses (U+2026, U+2025): also used in runs without spaces in CJK text
    "。！？．｡"  # CJK and fullwidth/halfwidth forms
    "؟۔"  # Arabic question mark, Urdu full stop
    "।॥"  # Devanagari danda, double danda (Hindi, Bengali, Sanskrit...)
    "።፧፨"  # Ethiopic
    "։՜՞"  # Armenian full stop, exclamation, question
    "။"  # Myanmar
    "།༎"  # Tibetan
    "‼⁇⁈⁉⸮"  # double marks, reversed question mark
    ";"  # U+037E Greek question mark (not the ASCII semicolon)
    "჻᙮"  # Georgian, Canadian syllabics
)
_ENDS: Final = _SPACED_ENDS | _ANY_ENDS
# Closing quotes and brackets that belong to the sentence before the boundary.
_CLOSERS: Final = frozenset("\"')]}»›”’」』】〕〉》）〗〙〛＂＇］｝")
# Clause punctuation after which a length cut may fall (it reads naturally there).
_SOFT_BREAKS: Final = frozenset(",;:，、；：،؛")
# '.' after these (case-insensitive) is an abbreviation, not a sentence end.
_ABBREVIATIONS: Final = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e", "no", "fig", "approx"}
)


def _is_wide(ch: str) -> bool:
    """CJK ideographs, kana, hangul and fullwidth forms: scripts written without spaces."""
    o = ord(ch)
    return (
        0x2E80 <= o <= 0x9FFF  # CJK radicals, kana, CJK symbols, unified ideographs
        or 0xAC00 <= o <= 0xD7AF  # hangul syllables
        or 0xF900 <= o <= 0xFAFF  # CJK compatibility ideographs
        or 0xFF00 <= o <= 0xFFEF  # fullwidth / halfwidth forms
        or 0x20000 <= o <= 0x3FFFF  # CJK extensions B..
    )


def is_speakable(text: str) -> bool:
    """True when ``text`` has at least one letter or digit. Informational: segments without
    one (punctuation, emoji) are still generated."""
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)


class Cut(NamedTuple):
    """A segment and where it stands in the text pushed since the last flush or clear:
    ``text == pushed[start:end]`` (whitespace around it is outside the range)."""

    text: str
    start: int
    end: int


class Segmenter:
    """Incremental segmenter for one context. Not thread-safe (one session, one loop)."""

    __slots__ = ("_base", "_buf", "_scan", "chunk_length")

    def __init__(self, chunk_length: int = 200) -> None:
        if chunk_length < 1:
            raise ValueError(f"chunk_length must be >= 1, got {chunk_length}")
        self.chunk_length = chunk_length
        self._buf = ""
        self._base = 0  # offset of _buf[0] in the text pushed since the last flush or clear
        self._scan = 0  # buffer index from which the sentence scan resumes

    @property
    def buffered(self) -> int:
        """Characters held back (not yet in a segment)."""
        return len(self._buf)

    def head(self) -> str:
        """The start of the next segment as far as the buffer fixes it: the buffered text up
        to its last word boundary (whitespace or clause punctuation), stripped; "" without
        one. More text extends the next segment past it but does not change it (a sentence
        end inside it would have cut a segment already)."""
        buf = self._buf
        for k in range(len(buf), 0, -1):
            if buf[k - 1].isspace() or buf[k - 1] in _SOFT_BREAKS:
                return buf[:k].strip()
        return ""

    def push(self, text: str) -> list[str]:
        """Add streamed text; return the segments it completed (possibly none)."""
        return [c.text for c in self.push_cuts(text)]

    def flush(self) -> list[str]:
        """Cut now: everything buffered becomes (at most one) segment."""
        return [c.text for c in self.flush_cuts()]

    def push_cuts(self, text: str) -> list[Cut]:
        """`push`, with each segment's character range."""
        if not text:
            return []
        self._buf += text
        out: list[Cut] = []
        self._cut_sentences(out)
        while len(self._buf) >= self.chunk_length:
            cut = self._length_cut()
            self._emit(self._buf, cut, out)
            self._consume(cut)
            self._cut_sentences(out)
        return out

    def flush_cuts(self) -> list[Cut]:
        """`flush`, with each segment's character range; offsets start again from 0."""
        out: list[Cut] = []
        self._emit(self._buf, len(self._buf), out)
        self.clear()
        return out

    def clear(self) -> int:
        """Drop the buffer (cancel); returns how many characters were dropped. Offsets start
        again from 0."""
        n = len(self._buf)
        self._buf = ""
        self._base = 0
        self._scan = 0
        return n

    # ----------------------------------------------------------------------------- internals

    def _emit(self, buf: str, end: int, out: list[Cut]) -> None:
        """``buf[:end]`` (buf: the buffer, from its first character) as a segment, stripped."""
        piece = buf[:end]
        text = piece.strip()
        if text:  # punctuation or emoji alone is text too: the model decides how it sounds
            start = self._base + len(piece) - len(piece.lstrip())
            out.append(Cut(text, start, start + len(text)))

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._base += n
        self._scan = 0

    def _cut_sentences(self, out: list[Cut]) -> None:
        buf = self._buf
        i = self._scan
        n = len(buf)
        limit = self.chunk_length
        while i < n:
            if i >= limit:
                break  # no sentence end within chunk_length: push() cuts on length first
            ch = buf[i]
            if ch == "\n" or ch == "\r":
                self._emit(buf, i, out)
                buf = buf[i + 1 :]
                self._base += i + 1
                i, n = 0, len(buf)
                continue
            if ch not in _ENDS:
                i += 1
                continue
            j = i + 1
            while j < n and buf[j] in _ENDS:
                j += 1
            while j < n and buf[j] in _CLOSERS:
                j += 1
            if j >= n:
                break  # the next character decides; wait for it (or for flush)
            if j > limit:
                break  # the sentence would be longer than chunk_length: cut on length first
            if self._is_boundary(buf, i, j):
                self._emit(buf, j, out)
                buf = buf[j:]
                self._base += j
                i, n = 0, len(buf)
                continue
            i = j
        self._buf = buf
        self._scan = i

    @staticmethod
    def _is_boundary(buf: str, start: int, end: int) -> bool:
        """Is the terminator run ``buf[start:end]`` (closers included) a sentence end?"""
        run = buf[start:end]
        if any(c in _ANY_ENDS for c in run):
            return True
        nxt = buf[end]
        if not (nxt.isspace() or _is_wide(nxt)):
            return False  # 3.14, e.g.x, Hello!World
        if run.rstrip("".join(_CLOSERS)) == ".":
            k = start
            while k > 0 and (buf[k - 1].isalpha() or buf[k - 1] == "."):
                k -= 1
            word = buf[k:start]
            if word.lower() in _ABBREVIATIONS:
                return False
            if len(word) == 1 and word.isupper():
                return False  # an initial: "J. K. Rowling"
        return True

    def _length_cut(self) -> int:
        """Where to cut a buffer of >= chunk_length characters: after the last word boundary
        within the limit, else at the limit (moved back off combining marks)."""
        limit = self.chunk_length
        buf = self._buf
        for k in range(limit, 0, -1):
            if buf[k - 1] in _SOFT_BREAKS:
                return k
            if k < len(buf) and buf[k].isspace():
                return k
        cut = limit
        # Never separate a combining mark (Indic vowel signs, Arabic harakat) from its base.
        while 1 < cut < len(buf) and unicodedata.category(buf[cut])[0] == "M":
            cut -= 1
        return cut


# Seconds per character, by kind. Rough speaking rates: ~14-15 characters per second for
# alphabetic scripts (Latin, Cyrillic, Greek, Arabic, Hebrew, Indic...), ~4-5 syllables per
# second for Chinese characters and Korean syllables, ~8 kana per second. Digits are read as
# words ("2024" = "twenty twenty-four"); punctuation stands for a pause. The budget only has to
# be an upper bound that stops runaway generation, so generous is right.
_S_ALPHA: Final = 1 / 14
_S_SPACE: Final = 1 / 15
_S_HAN: Final = 1 / 4.5
_S_KANA: Final = 1 / 8
_S_HANGUL: Final = 1 / 6
_S_DIGIT: Final = 0.3
_S_PUNCT: Final = 0.15


def estimate_speech_seconds(text: str) -> float:
    """How long ``text`` takes to say, roughly (an over- rather than under-estimate)."""
    total = 0.0
    for ch in text:
        o = ord(ch)
        if 0x3040 <= o <= 0x30FF or 0xFF66 <= o <= 0xFF9D:
            total += _S_KANA
        elif 0xAC00 <= o <= 0xD7AF or 0x1100 <= o <= 0x11FF:
            total += _S_HANGUL
        elif _is_wide(ch) and unicodedata.category(ch)[0] == "L":
            total += _S_HAN
        elif ch.isdigit():
            total += _S_DIGIT
        elif ch.isspace():
            total += _S_SPACE
        elif unicodedata.category(ch)[0] in "LM":
            total += _S_ALPHA
        elif unicodedata.category(ch)[0] == "P":
            total += _S_PUNCT
    return total
