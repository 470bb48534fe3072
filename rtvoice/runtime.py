"""What every session of one server shares — settings, the loaded model, the engine, the voice
store, the thread pools, the counters — with its start and stop, and the two questions a
session or the voices API asks of the model: a reference clip's codes, and how much text a
voice leaves room for."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final, Protocol

import numpy as np
import torch

from engine.engine import Engine, build_engine
from engine.errors import (
    BadReferenceAudio,
    EngineOverloaded,
    PromptTooLong,
    ReferenceAudioTooLong,
)
from engine.loader import Bundle, load_bundle
from engine.prompt import Reference
from engine.reference_audio import reference_from_bytes
from engine.request import Chunking
from engine.sampler import SamplingParams
from protocol import ErrorCode, ProtocolError, TTSRequest
from rtvoice.gc_pauses import GcWatch, freeze, unfreeze
from rtvoice.memory import trim_loop
from rtvoice.metrics import Metrics
from rtvoice.settings import Settings
from rtvoice.turns import segment_chars
from rtvoice.voices import UnknownVoice, VoiceLimitError, VoiceStore, VoiceStoreConfig

__all__ = ["DEFAULT_VOICE_ALIASES", "LiveSession", "Runtime", "known_error"]

# Voice ids and names that mean "the model's default voice" unless a stored voice has them:
# the defaults of stock clients written for Fish's cloud (so they work with only the URL
# changed) and OpenAI's built-in voice names (POST /v1/audio/speech).
DEFAULT_VOICE_ALIASES: Final = frozenset({
    "933563129e564b19a115bedd57b7406a",  # livekit-plugins-fishaudio's DEFAULT_VOICE_ID
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
    "sage", "shimmer", "verse",  # OpenAI's voices
})

log = logging.getLogger(__name__)


async def _freeze_when_warm(engine: Engine) -> None:
    """Freeze again once the background captures are in (their graphs and compiled code are
    start-up objects too); no full collection first: traffic flows by then."""
    while not await asyncio.to_thread(engine.warmup.wait, 1.0):
        pass
    log.info("garbage collector: %d objects frozen after the background graph captures",
             freeze(collect=False))


def known_error(exc: BaseException) -> ProtocolError | None:
    """The protocol error an exception of ours stands for (the engine's, the voice store's,
    a clip's), or None for anything else (an unexpected failure: `internal`)."""
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return ProtocolError(ErrorCode.OVERLOADED, f"the engine is at capacity: {exc}",
                             limit="max_waiting")
    if isinstance(exc, PromptTooLong | VoiceLimitError | ReferenceAudioTooLong):
        return ProtocolError(ErrorCode.TOO_LARGE, str(exc))
    if isinstance(exc, BadReferenceAudio):
        return ProtocolError(ErrorCode.BAD_REFERENCE_AUDIO, str(exc))
    if isinstance(exc, UnknownVoice):
        return ProtocolError(ErrorCode.UNKNOWN_VOICE, str(exc))
    return None


class LiveSession(Protocol):
    """A connected session, as the server's shutdown sees it."""

    def server_stopping(self) -> None: ...

    def drain(self) -> None: ...

    def lapse(self) -> None: ...

    @property
    def queued_bytes(self) -> int: ...


@dataclass(slots=True)
class Runtime:
    settings: Settings
    bundle: Bundle
    engine: Engine
    store: VoiceStore
    encode_pool: ThreadPoolExecutor  # audio encoders (mp3/opus/resampling)
    codec_pool: ThreadPoolExecutor  # reference decoding + codec encoder (reference_workers)
    metrics: Metrics = field(default_factory=Metrics)
    session_ids: itertools.count[int] = field(default_factory=itertools.count)
    sessions: set[LiveSession] = field(default_factory=set)  # connected now (shutdown notices)
    sessions_by_key: dict[int, int] = field(default_factory=dict)  # API key index -> live
    # sockets kept open after finish{stop} for another start, oldest first (LiveSession)
    lingering: dict[LiveSession, None] = field(default_factory=dict)
    trimmer: asyncio.Task[None] | None = None  # memory.trim_loop
    gc_watch: GcWatch | None = None  # the collector's passes, timed (gc_pauses)
    gc_refreeze: asyncio.Task[None] | None = None  # freezes again once every graph is in
    # where the start went: model load, compile, each graph family, ready (seconds)
    startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def stopping(self) -> bool:
        """The server drains: new connections are refused, sessions end when their turns do."""
        return self.metrics.draining

    @classmethod
    async def start(cls, settings: Settings, bundle: Bundle | None = None, *,
                    build_off_loop: bool = False) -> Runtime:
        """Load the model (unless `bundle` is given), build and start the engine, open the
        voice store. `build_off_loop`: build the engine (warm-ups, graph captures) on a worker
        thread, so that the event loop keeps serving meanwhile (/health while loading)."""
        t0 = time.perf_counter()
        m = settings.model
        if m.torch_threads:
            torch.set_num_threads(m.torch_threads)
        elif m.device == "cpu":
            # The engine runs prefill, decode and codec on their own threads; intra-op threads
            # on top of them only oversubscribe the cores (the tiny model's matmuls are small).
            torch.set_num_threads(1)
        if bundle is None:
            bundle = await asyncio.to_thread(load_bundle, m.model, device=m.device, dtype=m.dtype,
                                             seed=settings.engine.seed, max_seq_len=m.max_seq_len,
                                             fp8_keep=m.fp8_keep)
        load_s = time.perf_counter() - t0
        engine = (await asyncio.to_thread(build_engine, bundle, settings.engine) if build_off_loop
                  else build_engine(bundle, settings.engine))
        # Even the plain voice prompt (no reference) must leave room for a segment of
        # min_chunk_length characters, or no session could ever speak.
        room = segment_chars(engine.text_room([]))
        if room < settings.limits.min_chunk_length:
            raise ValueError(
                f"max_len={engine.max_len} leaves room for {max(0, room)} characters per "
                f"segment next to the plain voice prompt; min_chunk_length is "
                f"{settings.limits.min_chunk_length}: raise max_len")
        store = VoiceStore(settings.voices.data_dir,
                           VoiceStoreConfig(max_voices=settings.voices.max_voices))
        engine.start()
        pool = engine.runner.cache
        log.info("engine ready: model %s%s on %s, %d decode rows, KV pool of %d blocks x %d "
                 "positions (%d per session at most), voices in %s",
                 bundle.name, " (RANDOM WEIGHTS)" if bundle.random_weights else "", m.device,
                 engine.n_rows, pool.n_blocks, pool.block_size, engine.max_len,
                 settings.voices.data_dir)
        startup = {"load_s": load_s, **engine.startup_s, "ready_s": time.perf_counter() - t0}
        log.info("ready %.1fs after the start: %s%s", startup["ready_s"],
                 ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f}s"
                           for k, v in startup.items() if k != "ready_s"),
                 f"; {engine.warmup.pending} more graphs are captured in the background "
                 "(/ready: warming)" if engine.warmup.pending else "")
        trim_s = settings.service.heap_trim_s
        svc = settings.service
        if svc.gc_freeze:
            log.info("garbage collector: %d start-up objects frozen (never scanned again)",
                     freeze(collect=True))
        watch = GcWatch(svc.gc_warn_ms / 1000.0)  # from here on: the passes while serving
        watch.install()
        return cls(
            startup_s={k: round(v, 3) for k, v in startup.items()},
            settings=settings, bundle=bundle, engine=engine, store=store,
            encode_pool=ThreadPoolExecutor(settings.service.encode_threads, "rtvoice-encode"),
            # bounded: the codec encoder is a big torch op that already uses every core, and
            # the pool bounds the memory of clips decoding at once
            codec_pool=ThreadPoolExecutor(settings.limits.reference_workers, "rtvoice-codec"),
            trimmer=asyncio.create_task(trim_loop(trim_s), name="heap-trim") if trim_s else None,
            gc_watch=watch,
            gc_refreeze=(asyncio.create_task(_freeze_when_warm(engine), name="gc-refreeze")
                         if svc.gc_freeze and engine.warmup.pending else None),
        )

    async def stop(self) -> None:
        for task in (self.trimmer, self.gc_refreeze):
            if task is not None:
                task.cancel()
        if self.gc_watch is not None:
            self.gc_watch.uninstall()
        if self.settings.service.gc_freeze:
            unfreeze()
        await asyncio.to_thread(self.engine.shutdown)
        self.encode_pool.shutdown(wait=False, cancel_futures=True)
        self.codec_pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    async def reference(self, audio: bytes, text: str, what: str) -> tuple[Reference, int, float]:
        """Reference clip bytes -> (prompt `Reference` with codes, clip sample rate, clip
        seconds), decoded and encoded in the codec pool. Raises `ProtocolError`
        (bad_reference_audio / too_large, the message starting with `what`)."""
        loop = asyncio.get_running_loop()
        codec, lim, m = self.bundle.codec, self.settings.limits, self.metrics
        workers = lim.reference_workers

        def run() -> tuple[Reference, int, float]:
            return reference_from_bytes(codec, audio, text, max_seconds=lim.max_reference_s,
                                        max_samples=lim.max_reference_samples)

        jobs = m.references_running + m.references_waiting + 1
        m.references_running, m.references_waiting = min(jobs, workers), max(0, jobs - workers)
        try:
            return await loop.run_in_executor(self.codec_pool, run)
        except ReferenceAudioTooLong as exc:
            limit = "max_reference_samples" if exc.bound == "samples" else "max_reference_s"
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{what}: {exc}", limit=limit) from None
        except BadReferenceAudio as exc:
            raise ProtocolError(ErrorCode.BAD_REFERENCE_AUDIO, f"{what}: {exc}") from None
        finally:
            jobs = m.references_running + m.references_waiting - 1
            m.references_running = min(jobs, workers)
            m.references_waiting = max(0, jobs - workers)

    def claim_session(self, key: int | None) -> None:
        """Count a session (a socket's, from its 'start'; a REST request's) against
        max_sessions and its API key's max_sessions_per_key; `ProtocolError(overloaded)` when
        either is reached. Give it back with `release_session`."""
        lim, m = self.settings.limits, self.metrics
        if m.sessions_live >= lim.max_sessions:
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"the server is at its session limit ({lim.max_sessions}); retry later",
                limit="max_sessions")
        per_key = lim.max_sessions_per_key
        if per_key and key is not None and self.sessions_by_key.get(key, 0) >= per_key:
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"this API key holds {per_key} live sessions, its limit; close one or retry "
                "later", limit="max_sessions_per_key")
        m.sessions_live += 1
        if key is not None:
            self.sessions_by_key[key] = self.sessions_by_key.get(key, 0) + 1

    def release_session(self, key: int | None) -> None:
        self.metrics.sessions_live -= 1
        if key is not None:
            n = self.sessions_by_key.get(key, 0) - 1
            if n > 0:
                self.sessions_by_key[key] = n
            else:
                self.sessions_by_key.pop(key, None)

    def sampling(self, req: TTSRequest) -> SamplingParams:
        """A request's sampling parameters (server defaults for what it leaves out);
        `ProtocolError(bad_request)` naming a bad value."""
        top_k = req.top_k if req.top_k is not None else self.settings.service.default_top_k
        top_p = req.top_p
        if top_p <= 0.0:  # "no nucleus" = keep only the most likely token
            top_p, top_k = 1.0, 1
        seed = None if req.seed is None else req.seed % (2**31)
        try:
            return SamplingParams(temperature=req.temperature, top_p=top_p, top_k=top_k,
                                  seed=seed)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc), event="start") from None

    def chunking(self, req: TTSRequest) -> Chunking:
        """A request's own audio chunk sizes (the engine's settings for what it leaves out);
        `ProtocolError(invalid_field)` naming a bad value."""
        chunking = Chunking(first=req.first_chunk_frames, size=req.chunk_frames)
        try:
            self.engine.check_chunking(chunking)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.INVALID_FIELD, str(exc), event="start") from None
        return chunking

    async def voice(self, req: TTSRequest) -> list[Reference]:
        """A request's voice: a stored voice (``reference_id``, an id or a name, wins) or its
        inline clips, encoded to codes in the codec pool (up to reference_workers at once);
        no clips (or a default-voice alias) is the model's default voice."""
        voice_id = None if req.reference_id is None else await self.voice_id(req.reference_id)
        if voice_id is not None:
            try:
                voice = await asyncio.to_thread(self.store.get, voice_id)
            except UnknownVoice:  # deleted since
                raise ProtocolError(
                    ErrorCode.UNKNOWN_VOICE, f"no stored voice with id {req.reference_id!r}"
                ) from None
            codes = torch.from_numpy(np.array(voice.codes, dtype=np.int64))
            return [Reference(voice.transcript, codes)]
        lim = self.settings.limits
        if len(req.references) > lim.max_references:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"{len(req.references)} references; the limit is {lim.max_references}",
                limit="max_references")
        for i, ref in enumerate(req.references):
            if not ref.text.strip():
                raise ProtocolError(
                    ErrorCode.BAD_REFERENCE_AUDIO, f"references[{i}].text (the transcript) is empty"
                )
        jobs = [asyncio.ensure_future(self.reference(ref.audio, ref.text, f"references[{i}]"))
                for i, ref in enumerate(req.references)]
        try:
            done = await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        return [reference for reference, _, _ in done]

    async def voice_id(self, id_or_name: str) -> str | None:
        """The stored voice a request names (its id, else the newest voice with that name);
        None for the model's default voice (`DEFAULT_VOICE_ALIASES`, unless a stored voice
        has the id or name). `ProtocolError(unknown_voice)` otherwise."""
        info = await asyncio.to_thread(self.store.find, id_or_name)
        if info is not None:
            return info.id
        if id_or_name.lower() in DEFAULT_VOICE_ALIASES:
            log.info("voice %r is an alias of the model's default voice", id_or_name[:64])
            return None
        raise ProtocolError(ErrorCode.UNKNOWN_VOICE, f"no stored voice has the id or name "
                            f"{id_or_name[:128]!r} (GET /v1/voices lists them)")

    def voice_room(self, references: Iterable[Reference]) -> int:
        """Characters per segment this voice leaves room for in the engine's context;
        `ProtocolError(too_large)` when that is less than ``min_chunk_length`` (the voice
        cannot be served)."""
        room = segment_chars(self.engine.text_room(tuple(references)))
        need = self.settings.limits.min_chunk_length
        if room < need:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"the voice prompt (transcript + reference codes) leaves room for {max(0, room)} "
                f"characters per segment in the engine's context of {self.engine.max_len} "
                f"positions; at least {need} are needed: use a shorter clip or transcript",
                limit="max_len")
        return room
