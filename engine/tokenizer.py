"""Tokenizers: the checkpoint's HF `tokenizer.json`, or one built in code for the random-weight
presets: byte-level for `tiny` (the fixtures' tokenizer), BPE-like token counts for `s2-pro`.

Both expose the same small surface: `encode(text)` (special tokens written in the text are
matched whole; nothing is added), `decode(ids)`, `token_to_id`, and the id facts the engine
needs (semantic range, `<|im_end|>`).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Protocol

from .config import TINY_SPECIAL_BASE, TokenIds

# The 26 Qwen3 added tokens followed by fish-speech's 9, in id order (S2-Pro: 151643..151677).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|pad|>", "<|phoneme_start|>", "<|phoneme_end|>", "<|text|>", "<|voice|>", "<|interleave|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
)
N_SEMANTIC = 4096


class Tokenizer(Protocol):
    ids: TokenIds

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int: ...


class TokenizerError(ValueError):
    pass


class HFTokenizer:
    """A checkpoint's `tokenizer.json` through HF `tokenizers` (no `transformers` needed)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        self._tok = _Tok.from_file(str(p))
        first = self._tok.token_to_id("<|semantic:0|>")
        if first is None:
            raise TokenizerError(f"{p} has no <|semantic:0|> token: not an S2 tokenizer")
        # The reference takes the semantic range from the tokens themselves.
        sem = [self._tok.token_to_id(f"<|semantic:{i}|>") for i in range(N_SEMANTIC)]
        if any(s is None for s in sem) or sem != list(range(first, first + N_SEMANTIC)):
            raise TokenizerError(f"{p}: <|semantic:0..4095|> are not 4096 consecutive ids")
        self.ids = TokenIds(im_end=self.token_to_id("<|im_end|>"), pad=self.token_to_id("<|pad|>"),
                            audio_pad=self.token_to_id("<|audio_pad|>"), semantic_start=first,
                            semantic_end=first + N_SEMANTIC - 1)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary")
        return i


class ByteTokenizer:
    """Byte-level tokenizer for the built-in `tiny` model: ids 0..255 are UTF-8 bytes, then the
    35 special tokens, then `<|semantic:0..4095|>`. Any text in any script round-trips."""

    def __init__(self, special_base: int = TINY_SPECIAL_BASE) -> None:
        # special_base=151643 gives the real S2-Pro special/semantic ids (dummy s2-pro runs).
        base = special_base
        if base < 256:
            raise ValueError("special_base must leave ids 0..255 to the bytes")
        self._special = {t: base + i for i, t in enumerate(SPECIAL_TOKENS)}
        sem0 = base + len(SPECIAL_TOKENS)
        self._by_id = {i: t for t, i in self._special.items()}
        self.ids = TokenIds(im_end=self._special["<|im_end|>"], pad=self._special["<|pad|>"],
                            audio_pad=self._special["<|audio_pad|>"], semantic_start=sem0,
                            semantic_end=sem0 + N_SEMANTIC - 1)
        self.vocab_size = sem0 + N_SEMANTIC
        self._base = base
        alt = "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
        self._split = re.compile(f"({alt}|<\\|semantic:\\d+\\|>)")

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            if piece in self._special:
                out.append(self._special[piece])
            elif piece.startswith("<|semantic:") and int(piece[11:-2]) < N_SEMANTIC:
                out.append(self.ids.semantic_start + int(piece[11:-2]))
            else:
                out.extend(piece.encode("utf-8"))
        return out

    def decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:  # bytes
                buf.append(i)
                continue
            if buf:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if i in self._by_id:
                parts.append(self._by_id[i])
            elif 256 <= i < self._base:
                raise TokenizerError(f"id {i} is outside the byte tokenizer's vocabulary")
            elif self.ids.semantic_start <= i <= self.ids.semantic_end:
                parts.append(f"<|semantic:{i - self.ids.semantic_start}|>")
            else:
                raise TokenizerError(f"id {i} is outside the byte tokenizer's vocabulary")
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_to_id(self, token: str) -> int:
        if token in self._special:
            return self._special[token]
        m = re.fullmatch(r"<\|semantic:(\d+)\|>", token)
        if m and int(m.group(1)) < N_SEMANTIC:
            return self.ids.semantic_start + int(m.group(1))
        raise TokenizerError(f"token {token!r} is not in the vocabulary")


# CJK ideographs, kana, hangul: a BPE tokenizer spends about one token per character on them.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_PIECES = re.compile(f"([{_CJK}])|( ?[^\\W{_CJK}]+)|(\\s)|(.)", re.S)


class PieceTokenizer:
    """A tokenizer with BPE-like token counts for the random-weight `s2-pro` preset, so that
    prompts (and the benches' prefill cost) have the real model's lengths: a word with its
    leading space is one token up to 7 characters, longer words one token per 5; one token
    per CJK character, punctuation mark or other space (English: ~4 characters per token,
    as S2-Pro's Qwen3 BPE). Pieces map to ids below the special tokens by a hash, so encoding
    is the same in every process. Special and semantic tokens are those of `ByteTokenizer`.
    `decode` works for the pieces this tokenizer has encoded (and refuses an id two pieces
    share, rather than guess)."""

    WORD, LONG = 7, 5

    def __init__(self, special_base: int) -> None:
        self._bytes = ByteTokenizer(special_base)
        self.ids = self._bytes.ids
        self.vocab_size = self._bytes.vocab_size
        self._n = special_base  # piece ids: [0, special_base)
        self._seen: dict[int, str | None] = {}  # id -> its piece (None: several)

    def _id(self, piece: str) -> int:
        h = int.from_bytes(hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest(), "little")
        i = h % self._n
        prev = self._seen.get(i, piece)
        self._seen[i] = piece if prev == piece else None
        return i

    def pieces(self, text: str) -> list[str]:
        """The pieces `encode` gives ids to (special tokens aside)."""
        out: list[str] = []
        for m in _PIECES.finditer(text):
            word = m.group(2)
            if word is None:
                out.append(m.group(0))
            elif len(word) <= self.WORD:
                out.append(word)
            else:
                out.extend(word[k: k + self.LONG] for k in range(0, len(word), self.LONG))
        return out

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in self._bytes._split.split(text):
            if not part:
                continue
            if part in self._bytes._special or part.startswith("<|semantic:"):
                out.extend(self._bytes.encode(part))
            else:
                out.extend(self._id(p) for p in self.pieces(part))
        return out

    def decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        for i in ids:
            if 0 <= i < self._n:
                if i not in self._seen:
                    raise TokenizerError(f"id {i} is no piece this tokenizer has encoded")
                piece = self._seen[i]
                if piece is None:
                    raise TokenizerError(f"id {i} stands for several pieces (hashed vocabulary "
                                         f"of the random-weight preset): decode is ambiguous")
                parts.append(piece)
            else:
                parts.append(self._bytes.decode([i]))
        return "".join(parts)

    def token_to_id(self, token: str) -> int:
        return self._bytes.token_to_id(token)


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """`None` -> the built-in byte tokenizer; else the checkpoint's tokenizer.json."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
