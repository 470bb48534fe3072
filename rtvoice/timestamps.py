"""Segment timestamps: a segment's words placed on its audio's time span.

The model gives no alignment between text and audio, so word times are *estimates*: each
word gets a share of the segment's span proportional to how long it takes to say
(`estimate_speech_seconds`, per script), the whitespace after it included. Before the segment's
audio is complete its span is not known either; the speaking-rate model alone places the words
then. Events carry ``timing: "estimated"`` for this reason.

Words are runs of non-space characters; in scripts written without spaces (CJK) every
character is a word, so a barge-in point maps to a character there too.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

from protocol import Segment, Word
from rtvoice.segmenter import estimate_speech_seconds

__all__ = ["segment_event", "split_words"]

# a run of CJK ideographs / kana / hangul / fullwidth forms (with trailing punctuation), or a
# run of other non-space characters
_WORD: Final = re.compile(
    r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef][^\s\u2e80-\u9fff\uac00-\ud7af"
    r"\uf900-\ufaff\uff00-\uffef\w]*|[^\s\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]+")
_MIN_WEIGHT: Final = 0.05  # seconds: punctuation or emoji alone still takes a moment


def split_words(text: str) -> list[tuple[str, int, int]]:
    """The words of `text` with their ``[start, end)`` character ranges; punctuation right
    after a word (``。``, ``」``) belongs to it."""
    out: list[tuple[str, int, int]] = []
    for m in _WORD.finditer(text):
        word, start, end = m.group(), m.start(), m.end()
        if out and out[-1][2] == start and not any(unicodedata.category(c)[0] in "LNS"
                                                    for c in word):
            out[-1] = (out[-1][0] + word, out[-1][1], end)
        else:
            out.append((word, start, end))
    return out


def segment_event(*, context_id: str | None, index: int, text: str, char_start: int,
                  start_s: float, end_s: float | None) -> Segment:
    """The ``segment`` event of a segment whose audio starts at `start_s` and ends at `end_s`
    (None: not yet known) on its context's timeline; `char_start`: where `text` begins in
    the turn's text."""
    words = split_words(text)
    weights = []
    for i, (_, ws, we) in enumerate(words):
        gap_end = words[i + 1][1] if i + 1 < len(words) else we  # the space after it counts
        weights.append(max(_MIN_WEIGHT, estimate_speech_seconds(text[ws:gap_end])))
    total = sum(weights)
    span = (end_s - start_s) if end_s is not None else total
    scale = span / total if total > 0 else 0.0
    out: list[Word] = []
    t = start_s
    for (word, ws, we), weight in zip(words, weights):
        t_end = t + weight * scale
        out.append(Word(text=word, start=round(t, 4), end=round(t_end, 4),
                        char_start=char_start + ws, char_end=char_start + we))
        t = t_end
    return Segment(
        context_id=context_id,
        index=index,
        text=text,
        char_start=char_start,
        char_end=char_start + len(text),
        start=round(start_s, 4),
        end=None if end_s is None else round(end_s, 4),
        final=end_s is not None,
        words=out,
    )
