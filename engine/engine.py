"""The generation engine: sequences join and leave a continuously batched decode loop.

Callers (the service, `rtvoice synth`, the bench) use four thread-safe calls — `open`,
`submit`, `cancel`, `close` — and receive results through their `SequenceSink`. Everything
else happens on the engine thread, one `step()` at a time: commands, a bounded chunk of
prefill, one decode step for the whole running batch, one batched codec tick.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .codec import Codec, StreamingDecoder
from .prompt import PromptBuilder, Reference
from .request import FinishReason, Sequence, SequenceSink, SeqState, Turn, TurnResult
from .runner import ModelRunner
from .sampler import SamplingParams
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    max_running: int = 8  # KV slots: sequences (sessions) resident at once
    max_len: int = 2048  # KV positions per sequence (voice prompt + turns)
    prefill_chunk: int = 256  # columns per prefill call, so one long prompt cannot stall decode
    first_chunk_frames: int = 2  # frames in a turn's first audio chunk (TTFA)
    chunk_frames: int = 8  # frames in later chunks
    max_turn_frames: int = 2048  # hard cap per turn (~95 s of audio)
    max_waiting: int = 64  # sequences queued for a slot before `open` refuses
    seed: int = 0
    cuda_graphs: bool = True  # capture the frame step for every batch bucket (CUDA only)

    def __post_init__(self) -> None:
        for name in ("max_running", "max_len", "prefill_chunk", "first_chunk_frames",
                     "chunk_frames", "max_turn_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError("EngineConfig.max_waiting must be >= 0")


class EngineOverloaded(RuntimeError):
    pass


class TurnTooLong(ValueError):
    pass


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, codec: Codec,
                 config: EngineConfig | None = None) -> None:
        self.cfg = config or EngineConfig()
        self.runner = runner
        self.model_cfg = runner.cfg
        self.tok = tokenizer
        self.prompts = PromptBuilder(tokenizer, self.model_cfg.num_codebooks)
        self.codec = codec
        self.decoder = StreamingDecoder(codec, max_streams=max(1, self.cfg.max_running))
        self.frame_samples = codec.cfg.hop_length
        self.sample_rate = codec.cfg.sample_rate
        self.frame_rate = self.sample_rate / self.frame_samples
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._rng = random.Random(self.cfg.seed)
        self._waiting: deque[Sequence] = deque()  # need a slot
        self._live: dict[int, Sequence] = {}  # have a slot
        self._prefill_q: deque[Sequence] = deque()
        self._audio: list[tuple[Sequence, Turn]] = []  # turns whose audio is not yet all out
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._decode = runner.decode
        self.graphs = None
        if self.cfg.cuda_graphs and runner.device.type == "cuda":
            from .graphs import GraphedDecoder

            self.graphs = GraphedDecoder(runner, max_batch=self.cfg.max_running)
            self.graphs.capture()
            self._decode = self.graphs.decode
        self.stats = {"steps": 0, "frames": 0, "prefill_cols": 0, "decode_s": 0.0,
                      "prefill_s": 0.0, "codec_s": 0.0}

    # ================================================================ public, thread-safe
    def open(self, references: list[Reference] | tuple[Reference, ...], params: SamplingParams,
             sink: SequenceSink) -> Sequence:
        """Queue a session's voice prompt for prefill. `sink.on_ready` fires when it is in."""
        if len(self._waiting) >= self.cfg.max_waiting + max(0, self.free_slots()):
            raise EngineOverloaded(f"{len(self._waiting)} sessions already wait for a slot")
        system = self.prompts.system(tuple(references))
        if system.shape[1] + 64 > self.cfg.max_len:
            raise TurnTooLong(f"the voice prompt has {system.shape[1]} positions; the engine's "
                              f"context is {self.cfg.max_len} (use shorter references)")
        seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        seq = Sequence(next(self._ids), tuple(references), params, seed, sink, system_cols=system)
        self._post(lambda: self._admit(seq))
        return seq

    def submit(self, seq: Sequence, text: str, *, turn_id: str, max_frames: int | None = None) -> None:
        """Start a turn: `text` is spoken in the sequence's voice, continuing its context."""
        if not text.strip():
            raise ValueError("turn text is empty")
        budget = min(max_frames or self.cfg.max_turn_frames, self.cfg.max_turn_frames)
        turn = Turn(turn_id, text, budget)
        self._post(lambda: self._start_turn(seq, turn))

    def cancel(self, seq: Sequence) -> None:
        """Stop the running turn before the next decode step; no audio of it follows."""
        self._post(lambda: self._cancel(seq))

    def close(self, seq: Sequence) -> None:
        self._post(lambda: self._close(seq))

    def free_slots(self) -> int:
        return self.runner.cache.free_slots

    def load(self) -> dict[str, int]:
        return {"live": len(self._live), "waiting": len(self._waiting),
                "free_slots": self.free_slots(), "max_running": self.cfg.max_running}

    # ================================================================ thread
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="rtvoice-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _post(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception:  # the loop must survive anything a request can cause
                log.exception("engine step failed")
                busy = False
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def run_until_idle(self, timeout_s: float = 120.0) -> None:
        """Step on the caller's thread until no work is left (tests, offline synthesis)."""
        deadline = time.perf_counter() + timeout_s
        while self.step():
            if time.perf_counter() > deadline:
                raise TimeoutError("engine did not go idle in time")

    # ================================================================ one step
    def step(self) -> bool:
        did = self._drain_commands()
        did |= self._prefill_some()
        did |= self._decode_once()
        did |= self._codec_tick()
        self.stats["steps"] += 1
        return did

    def _drain_commands(self) -> bool:
        did = False
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return did
            did = True
            fn()

    # ---------------------------------------------------------------- commands
    def _admit(self, seq: Sequence) -> None:
        self._waiting.append(seq)
        self._assign_slots()

    def _assign_slots(self) -> None:
        while self._waiting and self.runner.cache.free_slots:
            seq = self._waiting.popleft()
            if seq.state is SeqState.CLOSED:
                continue
            seq.slot = self.runner.cache.alloc()
            self.runner.assign(seq.slot, seq.params, seq.seed)
            self._live[seq.seq_id] = seq
            seq.pending_cols, seq.pos = seq.system_cols, 0
            seq.state = SeqState.PREFILLING
            self._prefill_q.append(seq)

    def _start_turn(self, seq: Sequence, turn: Turn) -> None:
        if seq.state is SeqState.CLOSED:
            return
        if seq.turn is not None and seq.turn.finished is None:
            self._fail_turn(seq, turn, "a turn is already running on this sequence")
            return
        seq.turn = turn
        if seq.state is SeqState.IDLE:
            self._queue_turn_prefill(seq)
        # otherwise the voice prompt is still waiting/prefilling; _prefill_some picks it up after

    def _queue_turn_prefill(self, seq: Sequence) -> None:
        turn = seq.turn
        assert turn is not None
        new = self.prompts.user_turn(turn.text)
        close = [] if seq.closed_turn else [self.prompts.assistant_close()]
        cols = torch.cat([*close, new], dim=1)
        turn.closes_previous = bool(close)
        if seq.needs_rebuild or seq.pos + cols.shape[1] + min(turn.max_frames, 64) > self.cfg.max_len:
            cols = self._rebuild_context(seq, new)
            if cols is None:
                self._fail_turn(seq, turn, f"turn text is too long for the context "
                                           f"({self.cfg.max_len} positions)")
                return
        turn.cols, turn.prefilled = cols, 0
        seq.closed_turn = True
        seq.turn_start_pos = seq.pos
        turn.max_frames = min(turn.max_frames, self.cfg.max_len - seq.pos - cols.shape[1])
        seq.state = SeqState.TURN_PREFILL
        self._prefill_q.append(seq)

    def _rebuild_context(self, seq: Sequence, new: Tensor) -> Tensor | None:
        """Drop the oldest turns until system + recent turns + the new turn fit; re-prefill."""
        system = seq.system_cols
        assert system is not None
        keep: list[Tensor] = []
        budget = self.cfg.max_len - system.shape[1] - new.shape[1] - 64
        if budget < 0:
            return None
        for text, codes in reversed(seq.history):
            cols = torch.cat([self.prompts.user_turn(text), self.prompts.assistant_close(codes)], 1)
            if cols.shape[1] > budget:
                break
            keep.insert(0, cols)
            budget -= cols.shape[1]
        dropped = len(seq.history) - len(keep)
        seq.history = seq.history[dropped:]
        seq.needs_rebuild = False
        log.info("seq %d: context full, dropped %d oldest turns and re-prefills", seq.seq_id, dropped)
        seq.pos = 0
        return torch.cat([system, *keep, new], dim=1)

    def _cancel(self, seq: Sequence) -> None:
        # A turn whose generation ended but whose audio is still draining stops here too.
        for s, t in list(self._audio):
            if s is seq and t is not seq.turn:
                t.finished, t.cancelled = FinishReason.CANCELLED, True
                self._drop_audio(t)
                self._emit_end(seq, t)
        turn = seq.turn
        if turn is None or turn.finished is not None:
            return
        turn.cancelled = True
        if seq.state is SeqState.DECODING and turn.frames:
            self._finish_turn(seq, FinishReason.CANCELLED)
            return
        if seq.state in (SeqState.TURN_PREFILL, SeqState.DECODING):
            # Nothing of this turn was spoken: roll the cache back as if it never happened.
            seq.pos = seq.turn_start_pos
            seq.closed_turn = not turn.closes_previous
            seq.needs_rebuild = seq.pos == 0
            if seq in self._prefill_q:
                self._prefill_q.remove(seq)
        self._finish_turn(seq, FinishReason.CANCELLED, rollback=True)

    def _close(self, seq: Sequence) -> None:
        if seq.state is SeqState.CLOSED:
            return
        if seq.turn is not None and seq.turn.finished is None:
            seq.turn.cancelled = True
            self._finish_turn(seq, FinishReason.CANCELLED, notify=False)
        if seq in self._prefill_q:
            self._prefill_q.remove(seq)
        if seq.slot is not None:
            self.runner.cache.release(seq.slot)
            seq.slot = None
        self._live.pop(seq.seq_id, None)
        seq.state = SeqState.CLOSED
        self._assign_slots()

    # ---------------------------------------------------------------- prefill
    def _prefill_some(self) -> bool:
        """One chunk of prefill for the sequence at the head of the queue."""
        if not self._prefill_q:
            return False
        seq = self._prefill_q[0]
        t0 = time.perf_counter()
        try:
            done = self._prefill_chunk(seq)
        except Exception as e:  # a bad prompt must not take the engine down
            log.exception("prefill failed for seq %d", seq.seq_id)
            self._prefill_q.popleft()
            seq.sink.on_error(seq, f"prefill failed: {e}")
            self._close(seq)
            return True
        dt = time.perf_counter() - t0
        self.stats["prefill_s"] += dt
        seq.prefill_s += dt
        if done:
            self._prefill_q.popleft()
        return True

    def _prefill_chunk(self, seq: Sequence) -> bool:
        n = self.cfg.prefill_chunk
        if seq.state is SeqState.PREFILLING:
            cols = seq.pending_cols
            assert cols is not None and seq.slot is not None
            chunk = cols[:, :n]
            self.runner.prefill(seq.slot, chunk, seq.pos)
            seq.pos += chunk.shape[1]
            self.stats["prefill_cols"] += chunk.shape[1]
            seq.pending_cols = cols[:, n:]
            if seq.pending_cols.shape[1]:
                return False
            seq.pending_cols = None
            seq.state = SeqState.IDLE
            seq.sink.on_ready(seq, time.perf_counter() - seq.created_at)
            if seq.turn is not None and seq.turn.finished is None:
                self._queue_turn_prefill(seq)
            return True
        # a turn: prefill all columns but the last, which the first decode step feeds
        turn = seq.turn
        assert turn is not None and turn.cols is not None and seq.slot is not None
        body = turn.cols.shape[1] - 1
        chunk = turn.cols[:, turn.prefilled: min(body, turn.prefilled + n)]
        if chunk.shape[1]:
            self.runner.prefill(seq.slot, chunk, seq.pos)
            seq.pos += chunk.shape[1]
            turn.prefilled += chunk.shape[1]
            self.stats["prefill_cols"] += chunk.shape[1]
        if turn.prefilled < body:
            return False
        seq.next_col = turn.cols[:, -1].to(self.runner.device)
        turn.cols = None
        self.runner.sampling.begin_turn(seq.slot, self._turn_seed(seq))
        turn.ready_at = time.perf_counter()
        seq.state = SeqState.DECODING
        self._audio.append((seq, turn))
        return True

    def _turn_seed(self, seq: Sequence) -> int:
        return (seq.seed * 1_000_003 + len(seq.history) * 7919 + 1) % (2**31)

    # ---------------------------------------------------------------- decode
    def _decode_once(self) -> bool:
        batch = [s for s in self._live.values() if s.state is SeqState.DECODING]
        if not batch:
            return False
        t0 = time.perf_counter()
        dev = self.runner.device
        slots = torch.tensor([s.slot for s in batch], device=dev)
        positions = torch.tensor([s.pos for s in batch], device=dev)
        cols = torch.stack([s.next_col for s in batch])  # type: ignore[misc]
        try:
            frames = self._decode(slots, cols, positions, max(s.pos for s in batch) + 1)
        except Exception as e:
            log.exception("decode step failed for %d sequences", len(batch))
            for s in batch:
                self._finish_turn(s, FinishReason.ERROR, error=f"decode failed: {e}")
            return True
        host = frames.cpu()
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["frames"] += len(batch)
        im_end = self.model_cfg.ids.im_end
        for i, s in enumerate(batch):
            turn = s.turn
            assert turn is not None
            s.pos += 1
            s.next_col = frames[i]
            if int(host[i, 0]) == im_end:
                self._finish_turn(s, FinishReason.EOS)
                continue
            turn.frames.append(host[i])
            if len(turn.frames) >= turn.max_frames:
                self._finish_turn(s, FinishReason.LENGTH)
        return True

    # ---------------------------------------------------------------- endings
    def _finish_turn(self, seq: Sequence, reason: FinishReason, *, error: str | None = None,
                     rollback: bool = False, notify: bool = True) -> None:
        turn = seq.turn
        assert turn is not None
        turn.finished = reason
        seq.turn = None  # the sequence may take its next turn while this one's audio drains
        if seq.state in (SeqState.DECODING, SeqState.TURN_PREFILL):
            seq.state = SeqState.IDLE
        if not rollback and turn.ready_at is not None:
            # Frames fed back into the cache (all but the last) form the assistant turn.
            n_fed = max(0, len(turn.frames) - 1) if reason is not FinishReason.EOS else len(turn.frames)
            codes = (torch.stack(turn.frames[:n_fed], 1)[1:] if n_fed
                     else torch.zeros(self.model_cfg.num_codebooks, 0, dtype=torch.long))
            seq.history.append((turn.text, codes))
            seq.closed_turn = False
        if reason in (FinishReason.CANCELLED, FinishReason.ERROR):
            # No audio of this turn after this point.
            self._drop_audio(turn)
            if notify:
                self._emit_end(seq, turn, error)
        # EOS / LENGTH: the codec tick flushes the remaining frames, then emits the end.

    def _fail_turn(self, seq: Sequence, turn: Turn, message: str) -> None:
        now = time.perf_counter()
        seq.sink.on_turn_end(seq, TurnResult(turn.turn_id, FinishReason.ERROR, 0, 0.0,
                                             turn.submitted_at, None, None, now, error=message))

    def _emit_end(self, seq: Sequence, turn: Turn, error: str | None = None) -> None:
        frames = len(turn.frames)
        codes = torch.stack(turn.frames, 1)[1:] if frames else None
        res = TurnResult(turn.turn_id, turn.finished or FinishReason.ERROR, frames,
                         turn.samples_out / self.sample_rate, turn.submitted_at, turn.ready_at,
                         turn.first_audio_at, time.perf_counter(), codes=codes, error=error)
        seq.sink.on_turn_end(seq, res)

    # ---------------------------------------------------------------- codec
    def _drop_audio(self, turn: Turn) -> None:
        self._audio = [(s, t) for s, t in self._audio if t is not turn]
        if turn.codec_stream is not None:
            self.decoder.close(turn.codec_stream)
            turn.codec_stream = None

    def _codec_tick(self) -> bool:
        """Decode the pending frames of every turn that has a chunk's worth, in one batch."""
        work: dict[int, tuple[Sequence, Turn, Tensor]] = {}
        for s, turn in list(self._audio):
            pending = len(turn.frames) - turn.decoded_frames
            ended = turn.finished is not None
            if ended and pending == 0:
                self._drop_audio(turn)
                self._emit_end(s, turn)
                continue
            need = self.cfg.first_chunk_frames if turn.decoded_frames == 0 else self.cfg.chunk_frames
            if pending == 0 or (pending < need and not ended):
                continue
            if turn.codec_stream is None:
                turn.codec_stream = self.decoder.open()
            codes = torch.stack(turn.frames[turn.decoded_frames:], dim=1)[1:]  # [K, n]
            work[turn.codec_stream] = (s, turn, codes)
        if not work:
            return False
        t0 = time.perf_counter()
        out = self.decoder.decode({sid: c for sid, (_, _, c) in work.items()})
        self.stats["codec_s"] += time.perf_counter() - t0
        now = time.perf_counter()
        for sid, (s, turn, codes) in work.items():
            pcm = out[sid]
            pcm = pcm.detach().float().cpu().numpy() if isinstance(pcm, Tensor) else np.asarray(pcm)
            offset = turn.samples_out / self.sample_rate
            turn.decoded_frames += codes.shape[1]
            turn.samples_out += len(pcm)
            if turn.first_audio_at is None:
                turn.first_audio_at = now
            s.sink.on_audio(s, turn.turn_id, pcm, offset)
            if turn.finished is not None and turn.decoded_frames == len(turn.frames):
                self._drop_audio(turn)
                self._emit_end(s, turn)
        return True


class CollectingSink:
    """A sink that gathers everything (offline synthesis, tests)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.done = threading.Event()
        self.audio: list[np.ndarray] = []
        self.offsets: list[float] = []
        self.results: list[TurnResult] = []
        self.errors: list[str] = []
        self.prefill_s = 0.0

    def on_ready(self, seq: Sequence, prefill_s: float) -> None:
        self.prefill_s = prefill_s
        self.ready.set()

    def on_audio(self, seq: Sequence, turn_id: str, pcm: np.ndarray, offset_s: float) -> None:
        self.audio.append(pcm)
        self.offsets.append(offset_s)

    def on_turn_end(self, seq: Sequence, result: TurnResult) -> None:
        self.results.append(result)
        self.done.set()

    def on_error(self, seq: Sequence, message: str) -> None:
        self.errors.append(message)
        self.done.set()
        self.ready.set()

    def pcm(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)
