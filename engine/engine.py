"""The generation engine: a thin facade over the scheduler (every decision, engine/scheduler.py)
and three workers that move tensors (prefill, decode, codec), driven by threads.

Callers (the service, `rtvoice synth`, the benches) use four thread-safe calls — `open`,
`submit`, `cancel`, `close` — and receive results through their `SequenceSink`. Commands
are queued and run on the thread that owns the scheduler's decode side.

Two ways to drive the same scheduler and workers:
- **sync** (`step()` / `run_until_idle()`, and the naive mode): one thread runs, in turn,
  the queued commands, one prefill round, one decode step whose result it reads at once,
  and one codec tick.
- **pingpong** (`start()` with `pingpong=True`): a prefill thread (own CUDA stream) runs
  prefill rounds and hands finished jobs over with a CUDA event, which the decode thread
  polls between launches (a sequence joins once its prefill has landed: no stream waits
  on another, so a burst of prefills never holds up running turns); the decode thread
  launches step N (a captured CUDA graph) with a non-blocking copy of its result into
  pinned ping/pong buffer N%2, and only then reads step N-1's — so the GPU always has the
  next step queued and the host never waits on the step it just launched. Stop conditions
  and the next step's inputs live on the device (see `ModelRunner.step`); a sequence that
  stopped on the GPU costs at most one masked row. While prompts are prefilling, the
  decode thread launches no step no running turn needs yet (prefill first). A codec thread
  (own stream) decodes the new frames of all streams in one batched call per tick and
  calls the sinks.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from .cache import SlowKVCache
from .codec import Codec
from .codec_worker import CodecWorker
from .config import EngineConfig
from .decode_worker import DecodeWorker, Launched
from .errors import EngineOutOfMemory, EngineOverloaded, PromptTooLong
from .kernels.linear import LinearPlan
from .kv_pool import prompt_key
from .loader import Bundle
from .ops import Ops, build_ops
from .prefill_worker import PrefillWorker
from .prompt import PromptBuilder, Reference
from .quant import fp8_layers
from .request import Chunking, PrefillJob, Sequence, SequenceSink, Turn, TurnResult
from .runner import ModelRunner
from .sampler import SamplingParams
from .scheduler import Scheduler, new_stats
from .tokenizer import Tokenizer
from .warmup import BackgroundCapture

__all__ = ["CollectingSink", "Engine", "add_fp8_copies", "build_engine", "fit_kv_blocks"]

log = logging.getLogger(__name__)


Key = tuple[int, ...]  # a graph bucket, rows first: (rows, columns, span) or (streams, frames)

GPU_CONTEXTS_PER_ROW = 32  # the default pool's cap: sessions >> decode rows, memory permitting


def fit_kv_blocks(want: int | None, *, free_bytes: int, reserve_bytes: int, block_bytes: int,
                  block_size: int, max_len: int) -> int:
    """KV pool blocks to allocate: what fits in `free_bytes` after `reserve_bytes` (the pool
    has one scratch block on top), or `want` if fewer. Raises when not even one full
    context (max_len) fits."""
    fit = (free_bytes - reserve_bytes) // block_bytes - 1
    context = -(-max_len // block_size)
    if fit < context:
        raise EngineOutOfMemory(
            f"the KV pool does not fit on the GPU: {free_bytes / 2**30:.1f} GiB free after the "
            f"weights, {reserve_bytes / 2**30:.1f} GiB kept for activations and CUDA graphs "
            f"(kv_reserve_gib), and one context of {max_len} positions needs "
            f"{context * block_bytes / 2**20:.0f} MiB; lower max_len or free GPU memory")
    return int(fit) if want is None else min(want, int(fit))


# A deferred decode graph is captured while decoding pauses (~0.5 s each on the H200 with its
# eager warm-up step) only when every speaking turn's generated audio is this far ahead of
# its playback: the pause, plus the up to one chunk (8 frames, 0.37 s) the codec lags behind
_CAPTURE_LEAD_S = 1.5


class _CaptureAsk:
    """A deferred decode graph the stepping thread captures when decoding may pause; claimed once,
    either by that thread ("taken") or by the background capture giving up on it
    ("cancelled")."""

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.done = threading.Event()
        self.error: Exception | None = None
        self._state = "asked"
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        """Neither taken nor cancelled yet."""
        return self._state == "asked"

    def claim(self, state: str) -> bool:
        with self._lock:
            if self._state != "asked":
                return False
            self._state = state
            return True


def _first(keys: list[Key], rows: int) -> tuple[list[Key], list[Key]]:
    """Graph keys (rows first) split into those captured before the engine is ready (at
    most `rows` rows; every key when `rows` is 0) and those captured in the background."""
    if rows == 0:
        return keys, []
    return [k for k in keys if k[0] <= rows], [k for k in keys if k[0] > rows]


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, codec: Codec,
                 config: EngineConfig) -> None:
        if config.max_len != runner.max_len:
            raise ValueError(f"config.max_len {config.max_len} differs from the runner's "
                             f"{runner.max_len} (build engines with build_engine)")
        self.cfg = config
        self.runner = runner
        self.ops: Ops = runner.ops
        self.model_cfg = runner.cfg
        self.prompts = PromptBuilder(tokenizer, self.model_cfg.num_codebooks)
        self.frame_samples = codec.cfg.hop_length
        self.sample_rate = codec.cfg.sample_rate
        self.frame_rate = self.sample_rate / self.frame_samples
        self.cuda = runner.device.type == "cuda"
        self.stats = new_stats()
        cache = runner.cache
        block_bytes = SlowKVCache.position_bytes(self.model_cfg.slow, runner.dtype) \
            * cache.block_size
        self.scheduler = Scheduler(config, self.prompts, n_rows=runner.n_rows,
                                   n_blocks=cache.n_blocks, block_size=cache.block_size,
                                   sample_rate=self.sample_rate, frame_samples=self.frame_samples,
                                   ids=self.model_cfg.ids, stats=self.stats,
                                   # the scheduler's one device call: an idle session's
                                   # blocks to host memory (decode thread, done on return)
                                   evict=runner.save if config.kv_host_gib > 0 else None,
                                   block_bytes=block_bytes)
        self._ids = itertools.count(1)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._capture_ask: _CaptureAsk | None = None  # the deferred graph asked for
        self._wake = threading.Event()
        self._codec_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._threaded = False  # pingpong threads running
        # when each worker thread began the pass of its loop it is in (watchdog, set by
        # start()); None: the prefill thread waits for jobs
        self._pass_at: dict[str, float | None] = {}
        # One stream per thread; cfg.high_priority_streams get the device's higher priority.
        # Each family of CUDA graphs is captured on the stream that replays it: cuBLAS's
        # workspace is per stream and is baked into a captured graph, so graphs captured on
        # one stream and replayed concurrently on three would share one workspace (split-K
        # GEMMs coordinate through it).
        self.decode_worker = DecodeWorker(runner, self._stream("decode"),
                                          span_step=config.span_step, stats=self.stats,
                                          one_row=config.one_row_bucket)
        self.prefill_worker = PrefillWorker(runner, self._stream("prefill"),
                                            chunk=config.prefill_chunk,
                                            batch=config.prefill_batch, stats=self.stats)
        graphed_codec = config.codec_graphs and codec.device.type == "cuda"
        self.codec_worker = CodecWorker(codec, self.ops.codec, self._stream("codec"),
                                        n_rows=runner.n_rows, graphed=graphed_codec,
                                        max_frames=config.max_turn_frames,
                                        call_frames=config.codec_call_frames or 0,
                                        stats=self.stats)
        # prefill thread state: jobs handed over / finished, and on the decode thread the
        # finished ones whose event has not completed yet
        self._prefill_in: queue.SimpleQueue[PrefillJob | None] = queue.SimpleQueue()
        self._prefill_out: queue.SimpleQueue[PrefillJob] = queue.SimpleQueue()
        self._landing: list[PrefillJob] = []
        self._sync_prefill: list[PrefillJob] = []  # sync mode: jobs with chunks left
        # Fast start: the graphs light traffic needs now, the rest in the background once
        # the threads run (engine/warmup.py); `startup_s` says where the time went.
        self.warmup = BackgroundCapture()
        self.startup_s: dict[str, float] = {}
        self.capture_s = self.codec_capture_s = 0.0
        t0 = time.perf_counter()
        if self.ops.fused == "compile":
            self.prefill_worker.warm()
            self.startup_s["compile_s"] = time.perf_counter() - t0
        if config.cuda_graphs and self.cuda:
            w = self.decode_worker
            # before ready: at least the smallest batch bucket (2 rows with compiled ops)
            first, rest = _first(w.keys(), config.ready_rows and max(config.ready_rows,
                                                                      w.batches[0]))
            self.startup_s["decode_warm_s"] = w.warm()
            # before serving, the warm-ups' cached blocks go back (captures never flush the
            # cache themselves: engine/capture.py)
            torch.cuda.empty_cache()
            self.startup_s["decode_graphs_s"] = w.capture(first)
            self.capture_s = self.startup_s["decode_warm_s"] + self.startup_s["decode_graphs_s"]
            log.info("captured %d decode graphs (batches %s; spans %s) in %.1fs", w.graphs,
                     w.batches, w.spans, self.capture_s)
            # the decode thread captures the rest itself, when quiet: smallest batches first
            self.warmup.add("decode", rest[::-1], self._capture_decode_later)
        if config.prefill_graphs and self.cuda:
            t1 = time.perf_counter()
            first, rest = _first(self.prefill_worker.graphs.keys(), config.ready_rows)
            if config.ready_rows and len(spans := self.prefill_worker.graphs.spans) > 1:
                # keys over the whole context wait too: only a session deep into a long
                # context reads that far, not one in its first minute
                rest += [k for k in first if k[2] == spans[-1]]
                first = [k for k in first if k[2] != spans[-1]]
            self.prefill_worker.capture(first)
            self.warmup.add("prefill", rest, self.prefill_worker.capture_later)
            self.startup_s["prefill_graphs_s"] = time.perf_counter() - t1
        if graphed_codec:
            if self.ops.fused == "compile":  # every specialisation of the compiled codec ops
                # now: the background captures of bigger buckets would compile them while
                # serving
                self.startup_s["codec_warm_s"] = self.codec_worker.warm()
            first, rest = _first(self.codec_worker.decoder.bucket_keys(), config.ready_rows)
            self.codec_capture_s = self.codec_worker.capture(first)
            self.warmup.add("codec", rest, self.codec_worker.capture_later)
            d = self.codec_worker.decoder
            log.info("captured %d codec graphs (streams %s x frames %s) in %.1fs", d.graphs,
                     d.stream_buckets, d.FRAME_BUCKETS, self.codec_capture_s)
            self.startup_s["codec_graphs_s"] = self.codec_capture_s
        if self.warmup.pending:
            log.info("ready with the graphs of up to %d rows; %d more (%s) will be captured in "
                     "the background once the engine runs", config.ready_rows,
                     self.warmup.pending, ", ".join(f"{f.name} {len(f.keys)}"
                                                    for f in self.warmup.families))

    # ================================================================ public, thread-safe
    @property
    def n_rows(self) -> int:
        """Decode rows: turns that speak at once."""
        return self.runner.n_rows

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def text_room(self, references: list[Reference] | tuple[Reference, ...]) -> int:
        """Text tokens one turn may have next to this voice prompt and still fit the context
        with room to speak; negative when the voice prompt leaves no room at all."""
        return self.scheduler.turn_room(self.prompts.system(tuple(references)).shape[1])

    def open(self, references: list[Reference] | tuple[Reference, ...], params: SamplingParams,
             sink: SequenceSink, chunking: Chunking | None = None) -> Sequence:
        """Queue a session's voice prompt for prefill. `sink.on_ready` fires when it is in.
        `chunking`: the session's own audio chunk sizes (checked here: ValueError)."""
        chunking = chunking or Chunking()
        self.check_chunking(chunking)
        if not self.scheduler.has_room():
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} sessions already wait for KV "
                                   f"blocks")
        if params.ras_window > self.runner.sampling.max_window:
            raise ValueError(f"ras_window {params.ras_window} exceeds the engine's "
                             f"{self.runner.sampling.max_window}")
        system = self.prompts.system(tuple(references))
        if self.scheduler.turn_room(system.shape[1]) < 0:
            raise PromptTooLong(f"the voice prompt has {system.shape[1]} positions and leaves no "
                                f"room for a turn in the engine's context of {self.max_len} "
                                f"(use shorter references)")
        seed = self.scheduler.seed_for(params.seed)
        seq = Sequence(next(self._ids), tuple(references), params, seed, sink, system_cols=system,
                       prompt_key=prompt_key(system), chunking=chunking)
        self._post(lambda: self.scheduler.admit(seq))
        return seq

    def check_chunking(self, chunking: Chunking) -> None:
        """ValueError naming the field unless 1 <= first <= size <= max_turn_frames (a field
        left None takes the engine's setting; a default first chunk is cut to the size)."""
        top = self.cfg.max_turn_frames
        for name, v in (("first_chunk_frames", chunking.first), ("chunk_frames", chunking.size)):
            if v is not None and not 1 <= v <= top:
                raise ValueError(f"{name} must be 1..{top} (the engine's max_turn_frames), "
                                 f"got {v}")
        size = chunking.size or self.cfg.chunk_frames
        if chunking.first is not None and chunking.first > size:
            raise ValueError(f"first_chunk_frames ({chunking.first}) must not exceed chunk_frames "
                             f"({size}{'' if chunking.size else ', the engine default'})")

    def submit(self, seq: Sequence, text: str, *, turn_id: str, max_frames: int | None = None,
               continues: bool = False) -> None:
        """Start a turn: `text` is spoken in the sequence's voice, continuing its context.
        `continues`: a later sentence of an utterance whose audio the client already plays —
        its prefill and its decode row come before those of turns that start an utterance."""
        if not text.strip():
            raise ValueError("turn text is empty")
        budget = min(max_frames or self.cfg.max_turn_frames, self.cfg.max_turn_frames)
        turn = Turn(turn_id, text, max(1, budget), continues=continues)
        self._post(lambda: self.scheduler.start_turn(seq, turn))

    def prefill_ahead(self, seq: Sequence, text: str) -> None:
        """The sequence's next turn will most likely begin with `text` (its text is still
        streaming): prefill what of its prompt that fixes now, if the sequence is idle
        (Scheduler.prefill_ahead). Never required; a turn that begins otherwise is exact."""
        self._post(lambda: self.scheduler.prefill_ahead(seq, text))

    def cancel(self, seq: Sequence) -> None:
        """Stop the running turn; no audio of it follows the `cancelled` turn end."""
        self._post(lambda: self.scheduler.cancel(seq))

    def close(self, seq: Sequence) -> None:
        self._post(lambda: self.scheduler.close(seq))

    def free_rows(self) -> int:
        return self.scheduler.free_rows

    def load(self) -> dict[str, int | float]:
        """Engine load for /ready, /metrics and logs (read across threads: a snapshot)."""
        s = self.scheduler
        return {"live": len(s.live), "waiting": len(s.waiting), "free_rows": s.free_rows,
                "max_running": self.n_rows, "queued_turns": len(s.row_queue) + len(s.block_queue),
                "kv_blocks": s.pool.n_blocks, "kv_blocks_free": s.pool.free,
                "kv_blocks_available": s.blocks_available(),
                "kv_block_size": s.pool.block_size, "offloaded": s.offloaded,
                "host_kv_bytes": s.host_bytes, "shared_prefixes": len(s.prefixes),
                "device_wait_s": round(self.device_wait_s(), 3),
                "loop_stall_s": round(self.loop_stall_s(), 3)}

    def warming(self) -> dict[str, dict[str, object]]:
        """Graphs still being captured in the background: {family: {captured, total}} (and
        `error` where a family's capture failed: those buckets stay eager). Empty once all
        are in."""
        return self.warmup.status()

    def warmed(self, timeout: float | None = None) -> bool:
        """Wait until the background capture is over (benches measure the steady state)."""
        return self.warmup.wait(timeout)

    def device_wait_s(self) -> float:
        """How long the decode or codec thread has been waiting on the device right now, or
        a launched prefill has been waiting to land (0 when none is). Normal waits last one
        step, one codec tick or one prefill round (milliseconds); a wait past `cfg.stall_s`
        means the GPU stopped making progress."""
        now = time.perf_counter()
        # the decode thread swaps the list; read it once. Stopped threads land nothing.
        landing = self._landing if self._threaded else []
        since = [self.decode_worker.waiting_since, self.codec_worker.waiting_since,
                 min((j.landed_at for j in landing), default=None)]
        return max((now - t for t in since if t is not None), default=0.0)

    def loop_stall_s(self) -> float:
        """How long a worker thread has been in one pass of its loop (0 when the threads are
        not running). A pass is one step, one codec tick or prefill round, or an idle wait of
        at most 20 ms (an idle prefill thread is in none); one past `cfg.stall_s` means that
        thread is stuck (on the host, or on the device: `device_wait_s` says which)."""
        if not self._threaded:
            return 0.0
        now = time.perf_counter()
        return max((now - t for t in self._pass_at.values() if t is not None), default=0.0)

    def stalled(self) -> bool:
        return max(self.device_wait_s(), self.loop_stall_s()) > self.cfg.stall_s

    def thread_stacks(self) -> str:
        """Where each engine thread is now (its innermost frames), for a stall's log line."""
        frames = sys._current_frames()
        return "".join(f"\n--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident])[-8:])
                       for t in self._threads if t.ident in frames)

    # ================================================================ threads
    def _capture_decode_later(self, keys: list[tuple[int, int]], stop: Callable[[], bool],
                              captured: Callable[[tuple[int, int]], None]) -> None:
        """The background capture's decode family. Capturing a step sets every decode row
        inactive for a moment, so only the thread that launches steps may do it: each graph
        is handed to that thread, which captures it between two steps once nothing waits on
        decoding (`_capture_due`). Returns with keys left when no such moment came within a
        second (the background capture comes back to them); captures on the caller's thread
        when it is the one that steps (`step()` without `start()`)."""
        if not self.warmup.in_background():
            for key in keys:
                if stop():
                    return
                self.decode_worker.capture([key])
                captured(key)
            return
        for key in keys:
            ask = _CaptureAsk(key)
            self._capture_ask = ask  # one at a time: replaces a cancelled one
            self._wake.set()
            deadline = time.perf_counter() + 1.0
            while not ask.done.wait(0.02):
                if (stop() or time.perf_counter() > deadline) and ask.claim("cancelled"):
                    if self._capture_ask is ask:
                        self._capture_ask = None
                    return
            if ask.error is not None:
                raise ask.error
            captured(key)

    def _capture_due(self) -> bool:
        """A deferred decode graph is asked for, nothing prefills or waits, and every
        speaking turn is far enough ahead of playback to sit out its capture."""
        ask = self._capture_ask
        return (ask is not None and ask.open and not self._landing
                and self.scheduler.may_pause(time.perf_counter(), _CAPTURE_LEAD_S))

    def _capture_if_due(self) -> bool:
        """On the stepping thread, with no step in flight: capture the deferred decode graph
        asked for, when `_capture_due`. Returns whether it took the request."""
        ask = self._capture_ask  # a taken or cancelled one is no longer due
        if ask is None or not self._capture_due():
            return False
        if ask.claim("taken"):
            try:
                self.decode_worker.capture([ask.key])
            except Exception as e:  # the background capture reports it; the bucket stays eager
                ask.error = e
            finally:
                self.scheduler.decoding_paused()
                ask.done.set()
        return True

    def start(self) -> None:
        if self._threads:
            return
        self._stop.clear()
        if self.cfg.pingpong:
            self._pass_at = {"decode": time.perf_counter(), "codec": time.perf_counter(),
                             "prefill": None}
            self._threaded = True
            targets = [("rtvoice-decode", self._decode_loop), ("rtvoice-prefill", self._prefill_loop),
                       ("rtvoice-codec", self._codec_loop)]
        else:
            targets = [("rtvoice-engine", self._sync_loop)]
        # first: a sync loop's first step() must find the captures taken by their thread
        self.warmup.start()
        for name, fn in targets:
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        self.warmup.stop()
        self._stop.set()
        self._wake.set()
        self._codec_wake.set()
        self._prefill_in.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
        self._threaded = False

    def _stream(self, role: str) -> torch.cuda.Stream | None:
        if not self.cuda:
            return None
        # lower is higher; torch clamps to the device's range (a graph replay runs at the
        # priority of the stream it is launched into)
        return torch.cuda.Stream(self.runner.device,
                                 priority=-1 if role in self.cfg.high_priority_streams else 0)

    def _post(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def _run_commands(self) -> bool:
        did = False
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return did
            did = True
            try:
                fn()
            except Exception:
                log.exception("engine command failed")

    # ================================================================ sync: one loop
    def step(self) -> bool:
        """One pass of the sync loop: commands, a prefill round, a decode step read at once,
        a codec tick. Returns whether there was anything to do. An engine stepped without
        `start()` captures its remaining graphs first (once)."""
        if not self.warmup.started:
            self.warmup.run()
        did = self._run_commands()
        self._apply_row_ops()
        self._sync_prefill += self.scheduler.take_prefill_jobs()
        if self._sync_prefill:
            for job in self.prefill_worker.round(self._sync_prefill):
                self._sync_prefill.remove(job)
                self._land(job)
            did = True
        launched = self._launch(pause=False)
        if launched is not None:
            self._read(launched)
            did = True
        did = self._codec_tick() or did
        captured = self._capture_if_due()  # between two steps, if due
        return did or captured

    def run_until_idle(self, timeout_s: float = 120.0) -> None:
        """Step on the caller's thread until no work is left (tests, offline synthesis)."""
        deadline = time.perf_counter() + timeout_s
        while self.step():
            if time.perf_counter() > deadline:
                raise TimeoutError("engine did not go idle in time")

    def _sync_loop(self) -> None:
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

    # ================================================================ decode side
    def _apply_row_ops(self) -> None:
        """The row updates the scheduler decided so far, on the decode stream."""
        for op, e in self.decode_worker.apply(self.scheduler.take_row_ops()):
            log.error("decode row %d: %s failed: %s", op.row, op.kind, e)
            self.scheduler.row_failed(op.row, f"setting up its decode state failed: {e}")

    def _launch(self, *, pause: bool) -> Launched | None:
        """Schedule -> run: the next step (none while nothing runs, or while the batch pauses
        for prefills), after the row updates decided so far (the plan's included)."""
        plan = self.scheduler.plan_step(time.perf_counter(), may_pause=pause)
        self._apply_row_ops()
        # launched even if a failed op emptied the batch: a planned step is always read (its
        # number picks the ping/pong buffer; an empty step costs one pass of inactive rows)
        return self.decode_worker.launch(plan) if plan is not None else None


    def _read(self, step: Launched) -> None:
        """Postprocess: a launched step's frames to the scheduler."""
        if self.scheduler.step_done(step.k, step.B, self.decode_worker.read(step)):
            self._codec_wake.set()

    def _land(self, job: PrefillJob) -> None:
        """A finished prefill job: later steps wait for its event on the GPU; it joins (a
        failure fails only its sequence)."""
        if job.event is not None and not isinstance(job.event, Exception):
            try:
                self.decode_worker.wait_for(job.event)
            except Exception as e:
                log.exception("waiting for sequence %d's prefill failed", job.seq.seq_id)
                job.event = e
        self.scheduler.prefill_done(job)

    def _decode_loop(self) -> None:
        torch.set_grad_enabled(False)
        pending: Launched | None = None
        while not self._stop.is_set():
            self._pass_at["decode"] = time.perf_counter()
            try:
                did = self._run_commands()
                did |= self._poll_landings()
                self._hand_out_prefills()
                if self._capture_due():  # a deferred graph: the step in flight first, no next
                    if pending is not None:
                        self._read(pending)
                        pending = None
                    self._capture_if_due()
                    continue
                launched = self._launch(pause=True)
                if pending is not None:
                    self._read(pending)  # step N-1, while step N runs on the GPU
                    self._hand_out_prefills()  # a turn queued behind one that just ended
                    did = True
                pending = launched
                did |= launched is not None
            except Exception:
                log.exception("decode loop iteration failed")
                pending, did = None, False
                # a step dropped unread may still be running: let it finish before its
                # sequences' blocks are given back or re-prefilled on another stream
                self.decode_worker.settle()
                self.scheduler.fail_all_decoding("decode step failed (see server log)")
            if not did:
                # a prefill still on the GPU is polled often: its sequence joins (and its
                # TTFA clock runs) as soon as it lands; a paused batch resumes in time
                self._wake.wait(timeout=0.0005 if self._landing
                                else 0.002 if self.scheduler.prefill_outstanding else 0.02)
                self._wake.clear()

    def _hand_out_prefills(self) -> None:
        for job in self.scheduler.take_prefill_jobs():
            self._prefill_in.put(job)

    def _poll_landings(self) -> bool:
        """Join the sequences whose prefill the GPU has finished. A job whose event has not
        completed waits here (polled, not waited on): joining it at once would make the
        decode stream wait for its prefill round, stalling every running sequence's next
        frames behind a burst of prefills."""
        while True:
            try:
                job = self._prefill_out.get_nowait()
            except queue.Empty:
                break
            job.landed_at = time.perf_counter()
            self._landing.append(job)
        if not self._landing:  # the usual case, once per decode-loop iteration
            return False
        done: list[PrefillJob] = []
        landing: list[PrefillJob] = []
        for j in self._landing:
            # an Exception (failed prefill) or None (CPU) is done; a CUDA event when it says so
            (landing if hasattr(j.event, "query") and not j.event.query() else done).append(j)
        self._landing = landing
        for job in done:
            self._land(job)
        return bool(done)

    # ================================================================ prefill thread
    def _prefill_loop(self) -> None:
        torch.set_grad_enabled(False)
        active: list[PrefillJob] = []
        while not self._stop.is_set():
            try:  # take everything queued; block only when idle
                while True:
                    job = self._prefill_in.get(block=not active)
                    if job is None:
                        return
                    active.append(job)
            except queue.Empty:
                pass
            self._pass_at["prefill"] = time.perf_counter()
            finished = self.prefill_worker.round(active)
            self._pass_at["prefill"] = None  # idle until the next round (not a stall)
            for job in finished:
                active.remove(job)
                self._prefill_out.put(job)
            if finished:
                self._wake.set()

    # ================================================================ codec thread
    def _codec_loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._pass_at["codec"] = time.perf_counter()
            try:
                did = self._codec_tick()
            except Exception:
                log.exception("codec tick failed")
                did = False
            if not did:
                self._codec_wake.wait(timeout=0.01)
                self._codec_wake.clear()

    def _codec_tick(self) -> bool:
        """Schedule -> run -> postprocess: one batched decode of every stream with a chunk
        due. A failed tick ends its turns with an error and takes them off the batch."""
        plan = self.scheduler.plan_codec(time.perf_counter())
        self.codec_worker.release(plan.released)
        if not plan.work:
            return plan.busy
        try:
            pcm = self.codec_worker.decode(plan.work)
        except Exception as e:  # the turns of this tick end with an error; the loop goes on
            log.exception("codec decode failed for %d streams", len(plan.work))
            failed = self.scheduler.codec_failed(plan, e)
            self.codec_worker.release([t for _, t in failed])
            for s, turn in failed:
                self._post(lambda s=s, turn=turn: self.scheduler.abort_decoding(s, turn))
            return True
        self.codec_worker.release(self.scheduler.codec_done(plan, pcm))
        return True

    # ================================================================ measurements
    @property
    def measure_gaps(self) -> bool:
        return self.decode_worker.measure_gaps

    @measure_gaps.setter
    def measure_gaps(self, on: bool) -> None:
        self.decode_worker.measure_gaps = on

    def gpu_idle_gaps_ms(self) -> list[float]:
        """Idle time between consecutive measured steps (needs `measure_gaps = True`)."""
        return self.decode_worker.idle_gaps_ms()


def add_fp8_copies(model: torch.nn.Module, dense_plan: LinearPlan | None,
                    rowwise_plan: LinearPlan | None) -> None:  # on CUDA
    """The FP8 linears' bf16 copies where `dense_plan` measured them faster (fusion.
    add_dense_copies_where_faster, against the W8A8 rows too when there is a `rowwise_plan`)
    and their rowwise-scaled FP8 copies where `rowwise_plan` measured the rowwise W8A8 GEMM
    fastest (fusion.add_rowwise_copies); a GPU without room for them is a clear start-up
    error, with every copy made here dropped again."""
    from .fusion import add_dense_copies_where_faster, add_rowwise_copies
    from .quant import Fp8Linear

    gc.collect()  # as before the KV sizing: memory an earlier engine still holds
    torch.cuda.empty_cache()
    fresh = [mod for mod in model.modules()
             if isinstance(mod, Fp8Linear) and mod.dense_weight is None]
    added = rowwise = 0
    try:
        added = add_dense_copies_where_faster(model, dense_plan, rowwise_plan is not None)
        if rowwise_plan is not None:
            rowwise = add_rowwise_copies(model, pays=lambda n, k: rowwise_plan.rowwise_pays(
                n, k, dense=dense_plan is not None))
    except torch.cuda.OutOfMemoryError as e:
        for mod in fresh:  # the dense copies made before the rowwise ones ran out
            mod.dense_weight = None
        raise EngineOutOfMemory(
            "no GPU memory for the FP8 linears' bf16 copies (fp8_dense_copy: S2-Pro needs "
            "+8.1 GB) or their rowwise copies (fp8_activations: up to +4 GB); start with "
            "--no-fp8-dense-copy or without --fp8-activations, or on a GPU with more free "
            "memory") from e
    if added:
        log.info("FP8: bf16 copies of the FP8 linears for the batch sizes where the linear "
                 "table measured the dense kernels faster (+%.1f GiB)", added / 2**30)
    if rowwise:
        log.info("FP8: rowwise-scaled copies of the FP8 linears for the batch sizes where the "
                 "linear table measured the rowwise W8A8 GEMM fastest (+%.1f GiB)",
                 rowwise / 2**30)


def build_engine(bundle: Bundle, config: EngineConfig | None = None, *,
                 ops: Ops | None = None) -> Engine:
    """An engine over a loaded bundle (model, tokenizer, codec): its ops built once from the
    config (or `ops`, given), its KV cache sized from the memory left on a GPU, its graphs
    captured. Engines share nothing but the bundle's weights."""
    model = bundle.model
    device = model.embeddings.weight.device
    cuda = device.type == "cuda"
    cfg = (config or EngineConfig()).resolved(cuda=cuda, model_len=model.cfg.slow.max_seq_len)
    assert cfg.max_running is not None and cfg.max_len is not None
    t0 = time.perf_counter()
    if ops is None:  # on a fresh GPU machine nvcc builds csrc's extension here (~70 s)
        ops = build_ops(device, fused=cfg.fused_ops, kernels=cfg.cuda_kernels,
                        sampler_kernel=cfg.sampler_kernel, codec_kernels=cfg.codec_kernels,
                        split_kv=cfg.split_kv, linear_kernels=cfg.linear_kernels,
                        fp8_activations=cfg.fp8_activations, norm_fusion=cfg.norm_fusion,
                        pdl=cfg.pdl == "on" or (cfg.pdl == "auto" and bool(fp8_layers(model))),
                        fp8_dense=cfg.fp8_dense_copy, codec_conv_kernel=cfg.codec_conv_kernel,
                        attention_triton_rows=cfg.attention_triton_rows,
                        shared_prefix=cfg.attention_shared_prefix,
                        decode_rope=cfg.decode_rope_rows,
                        decode_rope_fast=cfg.fast_decode_rope_rows)
    ops_s = time.perf_counter() - t0
    if ops.packed_ffn:
        from .fusion import pack_ffn

        # W1|W3 in one buffer (same values; load_bundle's bundles come packed: then no-ops),
        # the codec transformers' too; the FP8 copies below go after, before the sizing
        pack_ffn(model)
        pack_ffn(bundle.codec)
    dense_plan = ops.dense_plan if cfg.fp8_dense_copy else None
    if (dense_plan is not None or ops.rowwise_plan is not None) and fp8_layers(model):
        add_fp8_copies(model, dense_plan, ops.rowwise_plan)  # before the KV pool's sizing
    n_rows, bs = cfg.max_running, cfg.kv_block_size
    context = -(-cfg.max_len // bs)
    n_blocks = cfg.kv_blocks or n_rows * 2 * context
    if cuda:  # size the pool from the memory left after the weights
        gc.collect()  # an earlier engine waiting for the cycle collector still holds memory
        torch.cuda.empty_cache()  # cached, unused blocks (weight loading) count as free
        free, _ = torch.cuda.mem_get_info(device)
        dtype = model.embeddings.weight.dtype
        block = SlowKVCache.position_bytes(model.cfg.slow, dtype) * bs
        n_blocks = fit_kv_blocks(cfg.kv_blocks or n_rows * GPU_CONTEXTS_PER_ROW * context,
                                 free_bytes=free, block_bytes=block, block_size=bs,
                                 reserve_bytes=int(cfg.kv_reserve_gib * 2**30),
                                 max_len=cfg.max_len)
        log.info("KV pool: %d blocks of %d positions (%.1f GiB, %.0f full contexts of %d); "
                 "%d decode rows", n_blocks, bs, n_blocks * block / 2**30,
                 n_blocks / -(-cfg.max_len // bs), cfg.max_len, n_rows)
    runner = ModelRunner(model, n_rows=n_rows, max_len=cfg.max_len, n_blocks=n_blocks,
                         block_size=bs, ops=ops)
    engine = Engine(runner, bundle.tokenizer, bundle.codec, cfg)
    engine.startup_s = {"ops_s": ops_s, **engine.startup_s}
    return engine


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

