"""Per-connection session state machine: pure logic, no I/O, no clock.

::

    connecting --start--> prefilling --prefill done--> ready --segment ready--> generating
                                                                   ^               |
                                                                   +---- idle <----+
    any open state --> closing --> closed          (any state --> closed: transport lost)

- ``connecting``: socket accepted, waiting for ``start``.
- ``prefilling``: the voice prompt is being prefilled. ``text`` is already accepted and
  buffered: Fish's SDK sends ``start``, its text and ``stop`` back to back without waiting.
- ``ready``: prefilled, nothing generated yet. ``generating``: at least one context is
  producing audio. ``idle``: prefilled, between turns.
- ``closing``: the server is sending its last events (``finish``) and closing the socket.
- ``closed``: done; nothing is legal.

``stop`` does not jump to ``closing``: Fish's semantics are "flush, finish all audio, then
``finish{stop}``", so a stop only sets :attr:`SessionStateMachine.stopping` (no further client
input except ``cancel``) and the session moves to ``closing`` once its work is drained. A stop
before ``start`` has nothing to drain and goes straight to ``closing``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

import msgspec

from .errors import ErrorCode, ProtocolError
from .schema import event_name

__all__ = [
    "ALLOWED_EVENTS",
    "TRANSITIONS",
    "InvalidTransition",
    "SessionState",
    "SessionStateMachine",
]


class SessionState(StrEnum):
    CONNECTING = "connecting"
    PREFILLING = "prefilling"
    READY = "ready"
    GENERATING = "generating"
    IDLE = "idle"
    CLOSING = "closing"
    CLOSED = "closed"


S = SessionState

TRANSITIONS: Final[dict[SessionState, frozenset[SessionState]]] = {
    S.CONNECTING: frozenset({S.PREFILLING, S.CLOSING, S.CLOSED}),
    S.PREFILLING: frozenset({S.READY, S.CLOSING, S.CLOSED}),
    S.READY: frozenset({S.GENERATING, S.CLOSING, S.CLOSED}),
    S.GENERATING: frozenset({S.IDLE, S.CLOSING, S.CLOSED}),
    S.IDLE: frozenset({S.GENERATING, S.CLOSING, S.CLOSED}),
    S.CLOSING: frozenset({S.CLOSED}),
    S.CLOSED: frozenset(),
}
"""Allowed ``from -> to`` moves. Self-transitions are not moves and are rejected."""

_SPEAKING = frozenset({"text", "flush", "stop", "cancel"})

ALLOWED_EVENTS: Final[dict[SessionState, frozenset[str]]] = {
    S.CONNECTING: frozenset({"start", "stop"}),
    S.PREFILLING: _SPEAKING,
    S.READY: _SPEAKING,
    S.GENERATING: _SPEAKING,
    S.IDLE: _SPEAKING,
    S.CLOSING: frozenset(),
    S.CLOSED: frozenset(),
}
"""Client events legal in each state (before ``stop``; after it only ``cancel`` is)."""

_AFTER_STOP: Final = frozenset({"cancel"})

_HINTS: Final[dict[SessionState, str]] = {
    S.CONNECTING: "send 'start' first",
    S.CLOSING: "the session is closing",
    S.CLOSED: "the session is closed",
}


class InvalidTransition(RuntimeError):
    """A ``from -> to`` move that the state machine does not allow (a server bug)."""

    def __init__(self, src: SessionState, dst: SessionState) -> None:
        self.src = src
        self.dst = dst
        super().__init__(f"invalid session transition {src.value} -> {dst.value}")


class SessionStateMachine:
    """The state of one connection and the rules for changing it.

    The session layer drives it: :meth:`apply` for each decoded client event (validates it and
    performs the transitions the event alone decides), :meth:`transition` for the moves that
    the server decides (prefill done, generation started/finished, closing, closed).
    """

    __slots__ = ("_state", "_stopping")

    def __init__(self, state: SessionState = S.CONNECTING) -> None:
        self._state = SessionState(state)
        self._stopping = False

    def __repr__(self) -> str:
        return f"SessionStateMachine({self._state.value}, stopping={self._stopping})"

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def stopping(self) -> bool:
        """``stop`` was received: drain, then close. Only ``cancel`` is accepted now."""
        return self._stopping

    @property
    def is_open(self) -> bool:
        return self._state not in (S.CLOSING, S.CLOSED)

    @property
    def is_prefilled(self) -> bool:
        """The voice prompt is in the cache, so segments may be generated."""
        return self._state in (S.READY, S.GENERATING, S.IDLE)

    def can_transition(self, dst: SessionState) -> bool:
        return dst in TRANSITIONS[self._state]

    def transition(self, dst: SessionState) -> SessionState:
        """Move to ``dst`` or raise :class:`InvalidTransition`. Returns the new state."""
        dst = SessionState(dst)
        if dst not in TRANSITIONS[self._state]:
            raise InvalidTransition(self._state, dst)
        self._state = dst
        return dst

    def allowed_events(self) -> frozenset[str]:
        allowed = ALLOWED_EVENTS[self._state]
        return allowed & _AFTER_STOP if self._stopping else allowed

    def check_event(self, event: msgspec.Struct | str) -> None:
        """Raise ``ProtocolError(invalid_state)`` if ``event`` is not legal now."""
        name = event if isinstance(event, str) else event_name(event)
        if name in self.allowed_events():
            return
        if self._stopping and self.is_open:
            hint = "the session is stopping ('stop' was received)"
        elif name == "start" and self.is_open:
            hint = "'start' may be sent only once per session"
        else:
            hint = _HINTS.get(self._state, "")
        context_id = None if isinstance(event, str) else getattr(event, "context_id", None)
        raise ProtocolError(
            ErrorCode.INVALID_STATE,
            f"event '{name}' is not allowed in state '{self._state.value}'"
            + (f": {hint}" if hint else ""),
            context_id=context_id,
            event=name,
        )

    def apply(self, event: msgspec.Struct | str) -> SessionState:
        """Validate a client event and perform the transition it decides on its own.

        ``start`` -> ``prefilling``; ``stop`` -> sets :attr:`stopping` (and -> ``closing``
        when received before ``start``). ``text``/``flush``/``cancel`` change no state here:
        whether they start generation is the session's decision. Returns the (new) state.
        """
        self.check_event(event)
        name = event if isinstance(event, str) else event_name(event)
        if name == "start":
            return self.transition(S.PREFILLING)
        if name == "stop":
            self._stopping = True
            if self._state is S.CONNECTING:
                return self.transition(S.CLOSING)
        return self._state
