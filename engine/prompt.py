"""The S2 chat prompt as a `[1 + K, T]` int matrix (row 0 token ids, rows 1..K codebook values).

Layout (DESIGN.md §3, pinned down by the reference fixtures):
  <|im_start|>system\\n{system parts}<|im_end|>\\n
  <|im_start|>user\\n{text}<|im_end|>\\n
  <|im_start|>assistant\\n<|voice|>            <- generation starts here
Each text part is tokenized on its own (joined strings would merge differently under BPE).
A VQ part contributes one column per frame: [semantic_start + c0, c0, ..., c9].
Multi-speaker text (`<|speaker:N|>` tags) is prepared as the reference prepares it: split at
each tag, each piece stripped, joined with "\n" (`turn_text`); a long one is generated in
groups of at most 5 speaker turns and chunk_length bytes (`speaker_batches`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from .tokenizer import Tokenizer

SYSTEM_PLAIN = "convert the provided text to speech"
SYSTEM_WITH_REFERENCE = "convert the provided text to speech reference to the following:\n\nText:\n"
SPEECH_HEADER = "\n\nSpeech:\n"
SPEAKER_TAG = re.compile(r"<\|speaker:\d+\|>")
_SPEAKER_SPLIT = re.compile(r"(<\|speaker:\d+\|>)")
# the reference's grouping of speaker turns into one generation: at most this many turns...
BATCH_SPEAKERS = 5


def speaker_turns(text: str) -> list[str]:
    """A text's speaker turns as the reference splits them: each `<|speaker:N|>` tag with the
    text up to the next tag, stripped; [] when the text has no tag. Text before the first
    tag is kept as a turn of its own (the reference drops it; losing words silently is worse
    than a prompt the reference would not build)."""
    parts = _SPEAKER_SPLIT.split(text)
    if len(parts) == 1:
        return []
    turns = [parts[0].strip()] if parts[0].strip() else []
    for i in range(1, len(parts), 2):
        turns.append((parts[i] + parts[i + 1]).strip())
    return turns


def turn_text(text: str) -> str:
    """The user text of one turn as the reference writes it: speaker turns joined with
    "\n"; text without a speaker tag as it is."""
    turns = speaker_turns(text)
    return "\n".join(turns) if turns else text


def speaker_batches(text: str, max_bytes: int, max_speakers: int = BATCH_SPEAKERS) -> list[str]:
    """A long multi-speaker text in the turns of generation the reference makes of it: its
    speaker turns grouped (each group at most `max_speakers` turns and, unless a single turn
    is longer, `max_bytes` UTF-8 bytes — the request's chunk_length) and joined with "\n".
    Text without a speaker tag is one batch, as it is."""
    turns = speaker_turns(text)
    if not turns:
        return [text]
    batches: list[str] = []
    current: list[str] = []
    size = 0
    for turn in turns:
        n = len(turn.encode("utf-8"))
        if current and (len(current) >= max_speakers or size + n > max_bytes):
            batches.append("\n".join(current))
            current, size = [], 0
        current.append(turn)
        size += n
    batches.append("\n".join(current))
    return batches


@dataclass(slots=True)
class Reference:
    """A voice reference: its transcript and its codes [K, F] (int)."""

    text: str
    codes: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.codes, Tensor) or self.codes.dim() != 2:
            raise ValueError("Reference.codes must be an int tensor [num_codebooks, frames]")
        if self.codes.dtype.is_floating_point:
            raise ValueError(f"Reference.codes must be integer, got {self.codes.dtype}")
        if self.codes.shape[1] == 0:
            raise ValueError("Reference.codes has no frames")


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, num_codebooks: int = 10) -> None:
        self.tok = tokenizer
        self.k = num_codebooks
        self.ids = tokenizer.ids
        self._cache: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ parts
    def text(self, s: str) -> Tensor:
        """A text part: [1+K, n] with zero codebook rows."""
        ids = self.tok.encode(s)
        out = torch.zeros(1 + self.k, len(ids), dtype=torch.long)
        out[0] = torch.tensor(ids, dtype=torch.long)
        return out

    def _fixed(self, s: str) -> Tensor:
        if s not in self._cache:
            self._cache[s] = self.text(s)
        return self._cache[s]

    def vq(self, codes: Tensor) -> Tensor:
        """A VQ part from codes [K, F]: row 0 = semantic_start + c0, rows 1..K = the codes."""
        if codes.dim() != 2 or codes.shape[0] != self.k:
            raise ValueError(f"codes must be [{self.k}, frames], got {list(codes.shape)}")
        c = codes.to(torch.long).cpu()
        if c.numel() and (int(c[0].min()) < 0 or int(c[0].max()) >= self.ids.n_semantic
                          or int(c.min()) < 0):
            raise ValueError(f"codes out of range: codebook 0 must be in [0, {self.ids.n_semantic})"
                             " and all codes >= 0")
        return torch.cat([(c[:1] + self.ids.semantic_start), c], dim=0)

    def _message(self, role: str, parts: list[Tensor], *, voice: bool = False,
                 close: bool = True) -> list[Tensor]:
        head = f"<|im_start|>{role}\n" + ("<|voice|>" if voice else "")
        out = [self._fixed(head), *parts]
        if close:
            out.append(self._fixed("<|im_end|>\n"))
        return out

    # ------------------------------------------------------------------ messages
    def system(self, references: list[Reference] | tuple[Reference, ...] = ()) -> Tensor:
        """The system message (closed with <|im_end|>\\n): the voice prompt of a session."""
        if not references:
            return torch.cat(self._message("system", [self._fixed(SYSTEM_PLAIN)]), dim=1)
        texts = [r.text if SPEAKER_TAG.search(r.text) else f"<|speaker:{i}|>{r.text}"
                 for i, r in enumerate(references)]
        codes = torch.cat([r.codes.to(torch.long).cpu() for r in references], dim=1)
        parts = [self._fixed(SYSTEM_WITH_REFERENCE), self.text("\n".join(texts)),
                 self._fixed(SPEECH_HEADER), self.vq(codes)]
        return torch.cat(self._message("system", parts), dim=1)

    def user_turn(self, text: str) -> Tensor:
        """User message (its text prepared as the reference does: `turn_text`) + the open
        assistant prefix `<|im_start|>assistant\\n<|voice|>`."""
        msgs = self._message("user", [self.text(turn_text(text))])
        msgs += self._message("assistant", [], voice=True, close=False)
        return torch.cat(msgs, dim=1)

    def user_head(self, text: str) -> Tensor:
        """The first columns of `user_turn(text + more)` as far as `text` alone fixes them:
        the user header and the text's tokens but the last (a BPE token at the end of a
        prefix may merge with what follows). [1+K, n], n >= the header's columns."""
        body = self.text(turn_text(text))
        return torch.cat([self._fixed("<|im_start|>user\n"), body[:, :-1]], dim=1)

    def assistant_close(self, codes: Tensor | None = None) -> Tensor:
        """Close an assistant turn. With `codes` [K, F] the frames are written out (the
        re-prefill form); without, they are assumed to be in the KV cache already."""
        parts = [self.vq(codes)] if codes is not None and codes.shape[1] else []
        return torch.cat([*parts, self._fixed("<|im_end|>\n")], dim=1)

    def build(self, text: str, references: list[Reference] | tuple[Reference, ...] = (),
              history: list[tuple[str, Tensor]] | tuple[tuple[str, Tensor], ...] = ()) -> Tensor:
        """A whole prompt: system, earlier (user text, generated codes) turns, the new turn."""
        cols = [self.system(references)]
        for past_text, past_codes in history:
            cols.append(self.user_turn(past_text))
            cols.append(self.assistant_close(past_codes))
        cols.append(self.user_turn(text))
        return torch.cat(cols, dim=1)
