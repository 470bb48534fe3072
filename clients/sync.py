"""Blocking wrapper around the asyncio client, for scripts and notebooks.

::

    from clients.sync import synthesize, SyncSession
    wav_bytes = synthesize("ws://127.0.0.1:8000", "Hello!", format="wav")

    with SyncSession("ws://127.0.0.1:8000", voice="alice", format="pcm") as s:
        for chunk in s.stream(["Hel", "lo ", "there."]):
            speaker.write(chunk.data)
        pcm, result = s.say("Second turn, same socket.")

The session lives on an event loop in a private daemon thread; each call hands a coroutine to
that loop and blocks on its result, so a ``SyncSession`` may be used from any one thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import wave
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from protocol import Ready

from .client import AudioChunk, Session, TurnResult, connect

__all__ = ["SyncSession", "synthesize", "write_wav"]

T = TypeVar("T")
_END = object()


def write_wav(path: str | Path, pcm_s16le: bytes, sample_rate: int, channels: int = 1) -> Path:
    """Write raw s16le PCM (the ``pcm`` format) as a WAV file."""
    path = Path(path)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm_s16le)
    return path


class SyncSession:
    """A :class:`~clients.client.Session` driven from blocking code. Keyword arguments are
    those of :func:`clients.client.connect`; it returns once the voice is ready."""

    def __init__(self, url: str, **connect_kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rtvoice-sync",
                                        daemon=True)
        self._thread.start()
        connect_kwargs.setdefault("wait_ready", True)

        async def open_session() -> Session:
            return await connect(url, **connect_kwargs)

        try:
            self.session: Session = self._call(open_session())
        except BaseException:
            self._shutdown()
            raise

    # ---------------------------------------------------------------- plumbing
    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _shutdown(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()

    # ---------------------------------------------------------------- API
    @property
    def info(self) -> Ready | None:
        return self.session.info

    def say(self, text: str | Iterable[str], *, context_id: str | None = None
            ) -> tuple[bytes, TurnResult]:
        """Speak one turn and wait for all of it: ``(audio bytes, TurnResult)``."""

        async def run() -> tuple[bytes, TurnResult]:
            tokens = [text] if isinstance(text, str) else list(text)
            turn = await self.session.feed(tokens, context_id=context_id)
            result = await turn
            return turn.audio_bytes, result

        return self._call(run())

    def stream(self, text: str | Iterable[str], *, context_id: str | None = None
               ) -> Iterator[AudioChunk]:
        """Speak one turn and yield its audio chunks as they arrive."""
        q: queue.Queue[Any] = queue.Queue()

        async def run() -> None:
            try:
                tokens = [text] if isinstance(text, str) else list(text)
                turn = await self.session.feed(tokens, context_id=context_id)
                chunks: AsyncIterator[AudioChunk] = aiter(turn)
                async for chunk in chunks:
                    q.put(chunk)
                q.put(_END)
            except BaseException as exc:
                q.put(exc)

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        complete = False
        try:
            while True:
                item = q.get()
                if item is _END:
                    complete = True
                    return
                if isinstance(item, BaseException):
                    complete = True
                    raise item
                yield item
        finally:
            if not complete:
                # The caller stopped listening (break, exception): stop the turn as well,
                # rather than block here until the server has said all of it.
                self._call(self.session.cancel(context_id))
            exc = fut.exception()
            if exc is not None and not complete:
                raise exc

    def cancel(self, context_id: str | None = None) -> None:
        self._call(self.session.cancel(context_id))

    def stop(self) -> None:
        """Finish every turn (Fish's ``stop``) and close."""
        try:
            self._call(self.session.stop())
        finally:
            self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            try:
                if self._loop.is_running():
                    self._call(self.session.close(), timeout=10)
            finally:
                self._shutdown()

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def synthesize(url: str, text: str | Iterable[str], **connect_kwargs: Any) -> bytes:
    """Speak ``text`` in one turn and return all its audio bytes (``format`` as asked; with
    ``format="wav"`` the bytes are a complete WAV stream)."""
    with SyncSession(url, **connect_kwargs) as s:
        data, _ = s.say(text)
    return data
