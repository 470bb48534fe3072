"""Live-server test helpers: a minimal protocol client over ``websockets`` and polling
helpers (shared by the live-server, hardening, fuzz and soak tests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import websockets

from protocol import (
    Audio,
    Done,
    Encoding,
    Error,
    Finish,
    Flush,
    Segment,
    Start,
    Stop,
    Text,
    TTSRequest,
    decode_server,
    encode_client,
)

RECV_TIMEOUT = 60.0


class Client:
    """A minimal protocol client over ``websockets`` (msgpack binary or JSON text frames)."""

    def __init__(self, ws: Any, encoding: Encoding) -> None:
        self.ws = ws
        self.encoding = encoding
        self.events: list[Any] = []
        # ``segment`` events (timestamps) are kept here, not returned by recv(), unless a test
        # asks for them: most tests look at the audio/done sequence only
        self.segments: list[Segment] = []
        self.keep_segments = False

    @classmethod
    async def connect(cls, url: str, encoding: Encoding = Encoding.MSGPACK) -> Client:
        ws = await websockets.connect(url, max_size=None, open_timeout=30)
        return cls(ws, encoding)

    async def send(self, event: Any) -> None:
        await self.ws.send(encode_client(event, self.encoding))

    async def send_raw(self, data: bytes | str) -> None:
        await self.ws.send(data)

    async def recv(self) -> Any:
        while True:
            frame = await asyncio.wait_for(self.ws.recv(), RECV_TIMEOUT)
            # The server answers in the client's encoding: text frames for JSON, binary for
            # msgpack.
            assert isinstance(frame, str) == (self.encoding is Encoding.JSON), type(frame)
            event = decode_server(frame)
            if isinstance(event, Segment) and not self.keep_segments:
                self.segments.append(event)
                continue
            self.events.append(event)
            return event

    async def until(self, stop: Callable[[Any], bool]) -> list[Any]:
        """Receive until ``stop(event)``; returns the events received, that one included."""
        out = []
        while True:
            ev = await self.recv()
            out.append(ev)
            if stop(ev):
                return out

    async def closed(self) -> int | None:
        """Wait for the server to close; returns the close code. After ``finish{stop}`` the
        server keeps the socket open for another ``start`` (as Fish's service does): then the
        client closes it, as Fish's clients do, and a normal close is 1000."""
        last = self.events[-1] if self.events else None
        if isinstance(last, Finish) and last.reason == "stop":
            await self.ws.close()
            return self.ws.close_code
        try:
            while True:
                await asyncio.wait_for(self.ws.recv(), RECV_TIMEOUT)
        except websockets.ConnectionClosed:
            pass
        return self.ws.close_code

    async def close(self) -> None:
        await self.ws.close()


def is_done(ctx: str | None = None) -> Callable[[Any], bool]:
    return lambda e: isinstance(e, Done) and e.context_id == ctx


def is_finish(e: Any) -> bool:
    return isinstance(e, Finish)


def audio_of(events: list[Any], ctx: str | None = None) -> list[Audio]:
    return [e for e in events if isinstance(e, Audio) and e.context_id == ctx]


def check_audio_sequence(audio: list[Audio]) -> None:
    """seq numbers 0.. with no gaps; offsets are the running sum of durations."""
    assert [a.seq for a in audio] == list(range(len(audio)))
    t = 0.0
    for a in audio:
        assert a.offset_s == pytest.approx(t, abs=1e-5)
        t += a.duration_s




def request(**kw: Any) -> TTSRequest:
    kw.setdefault("format", "pcm")
    kw.setdefault("max_new_tokens", 6)
    return TTSRequest(**kw)


async def speak(url: str, texts: list[str], *, encoding: Encoding = Encoding.MSGPACK,
                **req: Any) -> tuple[list[Any], int | None]:
    """One session: start, texts, flush, stop; returns (events, close code)."""
    c = await Client.connect(url, encoding)
    await c.send(Start(request=request(**req)))
    for t in texts:
        await c.send(Text(text=t))
    await c.send(Flush())
    await c.send(Stop())
    events = await c.until(is_finish)
    code = await c.closed()
    return events, code


async def poll(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def engine_state(engine: Any) -> str:
    """The scheduler's queues and every busy sequence, for a test that waited in vain."""
    sc = engine.scheduler
    busy = [f"{q!r} turn={q.turn and (q.turn.turn_id, q.turn.finished, q.turn.cancelled)} "
            f"queued={q.queued_turn and q.queued_turn.turn_id} draining={q.draining} "
            f"leave_step={q.leave_step} jobs={q.jobs_in_flight}"
            for q in list(sc.live.values())
            if q.turn is not None or q.queued_turn is not None or q.state.value != "idle"]
    return (f"load {engine.load()}; steps planned {sc.k}, read {sc.processed}; prefills "
            f"outstanding {sc.prefill_outstanding}; running {dict(sc.running)}; row queue "
            f"{list(sc.row_queue)}; block queue {list(sc.block_queue)}; waiting "
            f"{list(sc.waiting)}; busy {busy}; threads:{engine.thread_stacks()}")


def cached_blocks(engine: Any) -> int:
    """KV blocks held by the shared voice prefixes alone (kept for the next session)."""
    return engine.scheduler.prefixes.unused_blocks()


def engine_at_rest(url: Any) -> Callable[[], bool]:
    engine = url.app.state.runtime.engine

    def check() -> bool:
        load = engine.load()
        return (load["live"] == 0 and load["waiting"] == 0
                and engine.free_rows() == engine.n_rows
                and load["kv_blocks_free"] + cached_blocks(engine) == load["kv_blocks"]
                and engine.codec_worker.decoder.n_open == 0)

    return check


async def wait_at_rest(url: Any) -> None:
    await poll(engine_at_rest(url), "the engine still holds a session")


async def still_serving(url: str) -> None:
    """A fresh session still gets a whole turn."""
    events, code = await speak(url, ["Still here."], max_new_tokens=2)
    assert code == 1000 and any(isinstance(e, Done) for e in events)


async def next_error(c: Client) -> Error:
    return (await c.until(lambda e: isinstance(e, Error)))[-1]
