"""What the engine raises at its callers, and how it says whose fault a failed turn was."""

from __future__ import annotations

import enum


class EngineOverloaded(RuntimeError):
    """`open` refused: the KV pool is full and the queue waiting for it is full."""


class PromptTooLong(ValueError):
    """`open` refused: the voice prompt leaves no room in the context for a turn."""


class EngineOutOfMemory(RuntimeError):
    """Not even one full context of KV blocks fits in the GPU memory left after the weights."""


class TurnError(enum.StrEnum):
    """Why a turn ended with `FinishReason.ERROR`, by whose fault."""

    TOO_LARGE = "too_large"  # its text does not fit the context: the client's
    INVALID_STATE = "invalid_state"  # a turn while one runs, or on a closed sequence: the caller's
    INTERNAL = "internal"  # prefill, decode or the codec failed: ours
    OVERLOADED = "overloaded"  # no KV blocks for it and none can free: the server's capacity


class BadReferenceAudio(ValueError):
    """A reference clip that cannot be used (undecodable, empty, too short, or the codec's
    encoder failed on it); the message says which."""


class ReferenceAudioTooLong(BadReferenceAudio):
    """A reference clip that decodes but exceeds a limit: ``bound`` is ``"seconds"`` (its
    duration) or ``"samples"`` (samples x channels it would decode to)."""

    def __init__(self, message: str, bound: str = "seconds") -> None:
        super().__init__(message)
        self.bound = bound
