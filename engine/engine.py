"""The generation engine: sequences join and leave a continuously batched decode loop.

Callers (the service, `rtvoice synth`, the bench) use four thread-safe calls — `open`,
`submit`, `cancel`, `close` — and receive results through their `SequenceSink`.

Two ways to run the same code:
- **sync** (`step()` / `run_until_idle()`, and the naive mode): one thread does a command
  drain, a bounded chunk of prefill, one decode step whose result it reads at once, and
  one codec tick.
- **pingpong** (`start()` with `pingpong=True`): a prefill thread (own CUDA stream) runs
  prefills and hands finished sequences over with a CUDA event, which the decode thread
  polls between launches (a sequence joins once its prefill has landed: no stream waits
  on another, so a burst of prefills never holds up running turns); the decode thread launches
  step N (a captured CUDA graph), queues a non-blocking copy of its result into pinned
  ping/pong buffer N%2, and only then reads step N-1's buffer — so the GPU always has the
  next step queued and the host never waits on the step it just launched. Stop conditions
  and the next step's inputs live on the device (see `ModelRunner.step`); a sequence that
  stopped on the GPU costs at most one masked row. While prompts are prefilling, the
  decode thread launches no step that no running turn needs yet (every turn far enough
  ahead of realtime: `prefill_first_lead_s`), so a burst of prefills has the GPU to itself.
  A codec thread (own stream) decodes the new frames of all streams in one batched call per
  tick and calls the sinks.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .cache import SlowKVCache
from .capture import capture_graphs
from .codec import Codec, StreamingDecoder
from .loader import Bundle
from .prefill_graphs import PrefillGraphs
from .prompt import PromptBuilder, Reference
from .request import FinishReason, SeqState, Sequence, SequenceSink, Turn, TurnResult
from .runner import ModelRunner
from .sampler import SamplingParams
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Positions a (re)built context keeps free beyond a turn's prompt: room for this many frames
# of generation plus slack; the service sizes what a voice leaves for turns with the sum.
TURN_FRAMES_ROOM = 64
TURN_SLACK = 2
TURN_MARGIN = TURN_FRAMES_ROOM + TURN_SLACK


@dataclass(slots=True)
class EngineConfig:
    max_running: int = 8  # KV slots: sequences (sessions) resident at once
    max_len: int = 2048  # KV positions per sequence (voice prompt + turns)
    prefill_chunk: int = 256  # columns per prefill call, so one long prompt cannot stall others
    # frames in a turn's first audio chunk (TTFA): one frame is first audio one decode step
    # sooner (H200, c=64 burst: submit->audio 161 -> 104 ms p50, docs/PERF.md)
    first_chunk_frames: int = 1
    # Slow start: while the running batch generates less than this many times realtime per
    # stream, a turn's first chunk is twice first_chunk_frames. Chunks grow from the first
    # one, and a one-frame start leaves too thin a buffer when the first full-size chunk is
    # due at a slow rate (2-core CPU, c=8 at 1.7x realtime: 5 and 9 underruns of 24 turns
    # with one frame, 0 and 0 with two; docs/PERF.md). 0: never.
    slow_start_x: float = 2.0
    chunk_frames: int = 8  # frames in later chunks
    # a stream this far ahead of realtime playback (seconds of audio) lets its chunk wait
    # for a fuller codec tick, up to two chunks; 0: every chunk goes as soon as it is ready
    codec_hold_s: float = 1.0
    # Prefill first (pingpong): while prompts are prefilling, decode steps pause if no
    # running turn needs one, so a burst of prefills gets the GPU to itself instead of
    # sharing it with steps that only build up lead. A turn needs a step when its
    # generated audio is less than `prefill_first_lead_s` ahead of realtime playback (above
    # a chunk's 0.37 s: the codec lags generation by up to a chunk), or when it joined
    # without its first chunk's frames `prefill_first_wait_s` ago (the bound on what it
    # waits for other prefills). prefill_first_lead_s = 0: decode never pauses.
    prefill_first_lead_s: float = 0.5
    prefill_first_wait_s: float = 0.05
    max_turn_frames: int = 2048  # hard cap per turn (~95 s of audio)
    max_waiting: int = 64  # sequences queued for a slot before `open` refuses
    seed: int = 0
    cuda_graphs: bool = True  # capture the frame step for every batch bucket (CUDA only)
    pingpong: bool = True  # start() runs prefill/decode/codec threads; False: one sync loop
    span_step: int = 256  # attention-span bucket (graphs are captured per bucket)
    prefill_batch: int = 16  # sequences prefilled together in one forward
    fused_ops: str = "auto"  # "compile" | "reference" | "auto" (compile on CUDA only)
    codec_graphs: bool = True  # codec ticks as CUDA graphs per (streams, frames) bucket (CUDA only)
    # the codec's Snake activations (and the residual units' conv biases) as one-pass csrc
    # kernels, written straight into the next conv's input (CUDA with the extension built;
    # the torch formulas otherwise). The engine's graphed codec gives the offline decode's
    # audio with them (test_engine_audio_same_with_codec_graphs[True], H200); a 64x8 tick
    # 32.6 -> 27.6 ms (docs/PERF.md)
    codec_kernels: bool = True
    prefill_graphs: bool = True  # prefill chunks as CUDA graphs per (columns, span) bucket (CUDA only)
    stall_s: float = 10.0  # a device wait longer than this marks the engine stalled (/ready 503)
    # GPU memory kept out of the KV cache (activations, CUDA graph pools, the codec): the cache
    # takes min(max_running, what fits in the rest) slots, sized when the engine is built
    kv_reserve_gib: float = 8.0
    # the sampler's draw as one csrc kernel (csrc/sampling.cu) instead of the compiled torch
    # version (on a GPU with the extension built; 0.57 -> 0.47 ms of top-k per step at batch
    # 1, 0.80 -> 0.62 at 64, docs/PERF.md)
    sampler_kernel: bool = True
    # decode_attention splits a row's positions over more blocks when the batch is too small
    # to fill the GPU (batch <= 4 at S2-Pro's heads: a batch-1 launch is 32 blocks walking
    # every position in turn, latency-bound at long contexts). Off until measured on a GPU.
    split_kv: bool = False
    # CUDA streams whose kernels the block scheduler starts first when several are waiting
    # for SMs (the rest run at normal priority). Measured on the H200 at c=64 (docs/PERF.md):
    # decode+prefill high, prefill+codec high and all equal gave the same frames/s within
    # 4%; equal had the lowest submit->audio latency, so none is raised by default.
    high_priority_streams: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_running", "max_len", "prefill_chunk", "first_chunk_frames",
                     "chunk_frames", "max_turn_frames", "span_step", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError("EngineConfig.max_waiting must be >= 0")
        for name in ("codec_hold_s", "prefill_first_lead_s", "prefill_first_wait_s", "slow_start_x"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.stall_s > 0:
            raise ValueError(f"EngineConfig.stall_s must be > 0, got {self.stall_s}")
        if not self.kv_reserve_gib >= 0:
            raise ValueError(f"EngineConfig.kv_reserve_gib must be >= 0, got {self.kv_reserve_gib}")
        if not isinstance(self.high_priority_streams, (tuple, list)):
            raise ValueError("EngineConfig.high_priority_streams must be a tuple of stream "
                             f"names, got {self.high_priority_streams!r}")
        bad = set(self.high_priority_streams) - {"decode", "prefill", "codec"}
        if bad:
            raise ValueError(f"EngineConfig.high_priority_streams: unknown stream(s) "
                             f"{sorted(bad)}; choose from decode, prefill, codec")
        if self.fused_ops not in ("auto", "compile", "reference"):
            raise ValueError(f"EngineConfig.fused_ops must be auto, compile or reference, "
                             f"got {self.fused_ops!r}")


class EngineOverloaded(RuntimeError):
    pass


class TurnTooLong(ValueError):
    pass


class EngineOutOfMemory(RuntimeError):
    pass


def fit_kv_slots(want: int, *, free_bytes: int, reserve_bytes: int, slot_bytes: int,
                 max_len: int) -> int:
    """KV slots to allocate: `want`, or fewer if only fewer fit in `free_bytes` after
    `reserve_bytes` (the cache has one scratch slot on top). Raises when not even one fits."""
    fit = (free_bytes - reserve_bytes) // slot_bytes - 1
    if fit < 1:
        raise EngineOutOfMemory(
            f"the KV cache does not fit on the GPU: {free_bytes / 2**30:.1f} GiB free after the "
            f"weights, {reserve_bytes / 2**30:.1f} GiB kept for activations and CUDA graphs "
            f"(kv_reserve_gib), and one slot of {max_len} positions needs "
            f"{slot_bytes / 2**20:.0f} MiB; lower max_len or free GPU memory")
    return min(want, int(fit))


@dataclass(slots=True, eq=False)
class PrefillJob:
    seq: Sequence
    cols: Tensor  # [1+K, n] columns to write at `start`
    start: int
    turn: Turn | None  # None: the voice prompt
    slot: int = -1  # captured at queue time: the prefill thread never reads seq.slot
    done: int = 0
    event: object | None = None
    landed_at: float = 0.0  # when the decode thread took it (launched, maybe not done)


@dataclass(slots=True)
class _Pending:
    """A launched decode step whose result has not been read yet."""

    k: int
    B: int
    buf: Tensor
    event: object | None
    t_launch: float = 0.0


@dataclass(slots=True)
class _Gaps:
    """GPU idle time between consecutive decode steps, from CUDA events."""

    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, codec: Codec,
                 config: EngineConfig | None = None) -> None:
        self.cfg = config or EngineConfig()
        self.runner = runner
        self.model_cfg = runner.cfg
        self.tok = tokenizer
        self.prompts = PromptBuilder(tokenizer, self.model_cfg.num_codebooks)
        self.codec = codec
        self._graphed_codec = self.cfg.codec_graphs and codec.device.type == "cuda"
        self.decoder = StreamingDecoder(codec, max_streams=max(2, 2 * runner.n_slots),
                                        buckets=self._graphed_codec, graph_streams=runner.n_slots,
                                        max_frames=self.cfg.max_turn_frames)
        self.frame_samples = codec.cfg.hop_length
        self.sample_rate = codec.cfg.sample_rate
        self.frame_rate = self.sample_rate / self.frame_samples
        self.cuda = runner.device.type == "cuda"
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._device_wait: dict[str, float | None] = {"decode": None, "codec": None}
        self._rng = random.Random(self.cfg.seed)
        # scheduler state (decode thread, or the caller in sync mode)
        self._waiting: deque[Sequence] = deque()
        self._live: dict[int, Sequence] = {}
        self._owner: dict[int, Sequence] = {}  # slot -> sequence that may be active on the device
        self._prefill_jobs: deque[PrefillJob] = deque()  # sync mode
        self._prefill_in: queue.SimpleQueue[PrefillJob | None] = queue.SimpleQueue()
        self._prefill_out: queue.SimpleQueue[PrefillJob] = queue.SimpleQueue()
        self._prefill_landing: list[PrefillJob] = []  # launched, the GPU not done with them yet
        self._prefill_outstanding = 0  # jobs queued to the prefill thread and not joined yet
        self._k = 0  # decode steps launched
        # seconds per decode step (EMA over back-to-back launches; None until measured):
        # each step gives every running stream one frame, so it sets their speed
        self._step_s: float | None = None
        self._last_launch: float | None = None
        self._paused_at: float | None = None  # when the current pause for prefills began
        self._processed = -1  # last decode step whose result was read
        # audio (codec thread, or inline)
        self._audio: list[tuple[Sequence, Turn]] = []
        self._audio_lock = threading.Lock()
        self._emit_lock = threading.Lock()  # orders on_audio vs. a cancel's on_turn_end
        self._codec_wake = threading.Event()
        # threads and streams
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._running_pingpong = False
        # One stream per thread; cfg.high_priority_streams get the device's higher priority.
        # Each family of CUDA graphs is captured on the stream that replays it: cuBLAS's
        # workspace is per stream and is baked into a captured graph, so graphs captured on
        # one stream and replayed concurrently on three would share one workspace (split-K
        # GEMMs coordinate through it).
        self.prefill_stream = self._stream("prefill")
        self.decode_stream = self._stream("decode")
        self.codec_stream = self._stream("codec")
        W = runner.out_width
        self._bufs = [torch.zeros(runner.n_slots + 1, W, dtype=torch.long,
                                  pin_memory=self.cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self.gaps = _Gaps()
        self.measure_gaps = False
        self._batches = self._batch_buckets(runner.n_slots)
        # Span buckets bound the keys the prefill attention (and the decode step's torch
        # attention) reads; the decode_attention kernel reads exactly 0..pos, so with it the
        # decode graphs need one span only (12 graphs instead of 12 x spans).
        self._spans = [s for s in range(self.cfg.span_step, runner.cache.max_len, self.cfg.span_step)]
        self._spans.append(runner.cache.max_len)
        self._decode_spans = [runner.cache.max_len] if self._kernel_attention() else self._spans
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] | None = None
        # prefill keys over power-of-two spans: reading up to twice the keys needed costs
        # little next to the weights, and 4,096 positions need 5 span buckets, not 16
        max_len = runner.cache.max_len
        prefill_spans = [p for p in (2 ** k for k in range(8, 20)) if p < max_len] + [max_len]
        self.prefill_graphs = PrefillGraphs(runner, chunk=self.cfg.prefill_chunk,
                                            batch=self.cfg.prefill_batch, spans=prefill_spans)
        self.capture_s = 0.0
        from . import fusion, kernels

        if self.cuda:
            kernels.extension_available()  # nvcc builds it once: at start-up, not mid-request
        want = self.cfg.fused_ops
        if want == "auto":
            want = "compile" if self.cuda else "reference"
        self.fusion = fusion.enable(want, sampler_kernel=self.cfg.sampler_kernel and self.cuda)
        self.codec_kernels = fusion.codec_kernels(self.cfg.codec_kernels
                                                  and codec.device.type == "cuda")
        self.split_kv = fusion.split_kv(self.cfg.split_kv and self.cuda)
        if self.fusion == "compile":
            fusion.pack_ffn(runner.model)  # W1|W3 in one buffer: one GEMM per FFN input
            self._warm_prefill()
        if self.cfg.cuda_graphs and self.cuda:
            self._capture_graphs(self.decode_stream)
        if self.cfg.prefill_graphs and self.cuda:
            self.prefill_graphs.capture(self.prefill_stream)
        self.codec_capture_s = 0.0
        if self._graphed_codec:
            self.codec_capture_s = self.decoder.capture(self.codec_stream)
            log.info("captured %d codec graphs (streams %s x frames %s) in %.1fs",
                     self.decoder.graphs, self.decoder.stream_buckets,
                     self.decoder.FRAME_BUCKETS, self.codec_capture_s)
        self.stats = {"steps": 0, "frames": 0, "prefill_cols": 0, "decode_s": 0.0,
                      "prefill_s": 0.0, "codec_s": 0.0, "codec_ticks": 0, "wasted_rows": 0,
                      "prefill_calls": 0, "decode_pauses": 0, "decode_paused_s": 0.0}

    # ================================================================ public, thread-safe
    def open(self, references: list[Reference] | tuple[Reference, ...], params: SamplingParams,
             sink: SequenceSink) -> Sequence:
        """Queue a session's voice prompt for prefill. `sink.on_ready` fires when it is in."""
        if len(self._waiting) >= self.cfg.max_waiting + max(0, self.free_slots()):
            raise EngineOverloaded(f"{len(self._waiting)} sessions already wait for a slot")
        system = self.prompts.system(tuple(references))
        if system.shape[1] + 64 > self.runner.cache.max_len:
            raise TurnTooLong(f"the voice prompt has {system.shape[1]} positions; the engine's "
                              f"context is {self.runner.cache.max_len} (use shorter references)")
        seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        seq = Sequence(next(self._ids), tuple(references), params, seed, sink, system_cols=system)
        self._post(lambda: self._admit(seq))
        return seq

    def submit(self, seq: Sequence, text: str, *, turn_id: str, max_frames: int | None = None) -> None:
        """Start a turn: `text` is spoken in the sequence's voice, continuing its context."""
        if not text.strip():
            raise ValueError("turn text is empty")
        budget = min(max_frames or self.cfg.max_turn_frames, self.cfg.max_turn_frames)
        turn = Turn(turn_id, text, max(1, budget))
        self._post(lambda: self._start_turn(seq, turn))

    def cancel(self, seq: Sequence) -> None:
        """Stop the running turn; no audio of it follows the `cancelled` turn end."""
        self._post(lambda: self._cancel(seq))

    def close(self, seq: Sequence) -> None:
        self._post(lambda: self._close(seq))

    def free_slots(self) -> int:
        return self.runner.cache.free_slots

    def load(self) -> dict[str, int | float]:
        return {"live": len(self._live), "waiting": len(self._waiting),
                "free_slots": self.free_slots(), "max_running": self.runner.n_slots,
                "device_wait_s": round(self.device_wait_s(), 3)}

    def device_wait_s(self) -> float:
        """How long the decode or codec thread has been waiting on the device right now, or
        a launched prefill has been waiting to land (0 when none is). Normal waits last one
        step, one codec tick or one prefill round (milliseconds); a wait past `cfg.stall_s`
        means the GPU stopped making progress."""
        now = time.perf_counter()
        # the decode thread swaps the list; read it once. Stopped threads land nothing.
        landing = self._prefill_landing if self._running_pingpong else []
        since = [self._device_wait.get("decode"), self._device_wait.get("codec"),
                 min((j.landed_at for j in landing), default=None)]
        return max((now - t for t in since if t is not None), default=0.0)

    def stalled(self) -> bool:
        return self.device_wait_s() > self.cfg.stall_s

    # ================================================================ threads
    def start(self) -> None:
        if self._threads:
            return
        self._stop.clear()
        if self.cfg.pingpong:
            self._running_pingpong = True
            targets = [("rtvoice-decode", self._decode_loop), ("rtvoice-prefill", self._prefill_loop),
                       ("rtvoice-codec", self._codec_loop)]
        else:
            targets = [("rtvoice-engine", self._sync_loop)]
        for name, fn in targets:
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._codec_wake.set()
        self._prefill_in.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
        self._running_pingpong = False

    def _stream(self, role: str) -> torch.cuda.Stream | None:
        if not self.cuda:
            return None
        # lower is higher; torch clamps to the device's range (a graph replay runs at the
        # priority of the stream it is launched into)
        return torch.cuda.Stream(self.runner.device,
                                 priority=-1 if role in self.cfg.high_priority_streams else 0)

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Run on `stream` (CUDA), or nowhere in particular (CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _decode_ctx(self) -> contextlib.AbstractContextManager:
        """Every write to the runner's device state goes on the decode stream, so it lands
        between two steps, in launch order (a write on another stream could race a step in
        flight and be overwritten by it)."""
        return self._on(self.decode_stream)

    def _post(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

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

    def run_until_idle(self, timeout_s: float = 120.0) -> None:
        """Step on the caller's thread until no work is left (tests, offline synthesis)."""
        deadline = time.perf_counter() + timeout_s
        while self.step():
            if time.perf_counter() > deadline:
                raise TimeoutError("engine did not go idle in time")

    # ================================================================ sync step
    def step(self) -> bool:
        did = self._drain_commands()
        did |= self._prefill_inline()
        pend = self._launch() if self._owner else None
        self._note_launch(pend)
        if pend is not None:
            self._process(pend)
            did = True
        did |= self._codec_tick()
        return did

    def _drain_commands(self) -> bool:
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

    # ================================================================ commands
    def _admit(self, seq: Sequence) -> None:
        self._waiting.append(seq)
        self._assign_slots()

    def _assign_slots(self) -> None:
        while self._waiting and self.runner.cache.free_slots:
            seq = self._waiting.popleft()
            if seq.state is SeqState.CLOSED:
                continue
            seq.slot = self.runner.cache.alloc()
            with self._decode_ctx():
                self.runner.assign(seq.slot, seq.params, seq.seed)
            self._live[seq.seq_id] = seq
            seq.pos = 0
            seq.state = SeqState.PREFILLING
            assert seq.system_cols is not None
            self._queue_prefill(PrefillJob(seq, seq.system_cols, 0, None))

    def _queue_prefill(self, job: PrefillJob) -> None:
        assert job.seq.slot is not None
        job.slot = job.seq.slot
        if self._running_pingpong:
            self._prefill_outstanding += 1
            self._prefill_in.put(job)
        else:
            self._prefill_jobs.append(job)

    def _start_turn(self, seq: Sequence, turn: Turn) -> None:
        if seq.state is SeqState.CLOSED:
            self._fail_turn(seq, turn, "the sequence is closed", "invalid_state")
            return
        if (seq.turn is not None and not seq.draining) or seq.queued_turn is not None:
            self._fail_turn(seq, turn, "a turn is already running on this sequence", "invalid_state")
            return
        if seq.state is SeqState.IDLE and not seq.draining:
            seq.turn = turn
            self._queue_turn_prefill(seq)
        else:  # voice prompt not in yet, or a cancelled turn still draining on the device
            seq.queued_turn = turn

    def _queue_turn_prefill(self, seq: Sequence) -> None:
        turn = seq.turn
        assert turn is not None
        new = self.prompts.user_turn(turn.text)
        close = [] if seq.closed_turn else [self.prompts.assistant_close()]
        cols = torch.cat([*close, new], dim=1)
        turn.closes_previous = bool(close)
        max_len = self.runner.cache.max_len
        if seq.needs_rebuild or seq.pos + cols.shape[1] + min(turn.max_frames, TURN_FRAMES_ROOM) \
                + TURN_SLACK > max_len:
            rebuilt = self._rebuild_context(seq, new)
            if rebuilt is None:
                seq.turn = None
                self._fail_turn(seq, turn, f"turn text is too long for the context "
                                           f"({max_len} positions)", "too_large")
                return
            cols = rebuilt
        seq.closed_turn = True
        seq.turn_start_pos = seq.pos
        # -2: one position of slack for the frame a pingpong step may add after a cancel
        turn.max_frames = max(1, min(turn.max_frames, max_len - seq.pos - cols.shape[1] - 2))
        seq.state = SeqState.TURN_PREFILL
        turn.cols = cols
        # all columns but the last go through prefill; the first decode step feeds the last
        self._queue_prefill(PrefillJob(seq, cols[:, :-1], seq.pos, turn))

    def _rebuild_context(self, seq: Sequence, new: Tensor) -> Tensor | None:
        """Drop the oldest turns until system + recent turns + the new turn fit; re-prefill."""
        system = seq.system_cols
        assert system is not None
        keep: list[Tensor] = []
        budget = self.runner.cache.max_len - system.shape[1] - new.shape[1] - TURN_MARGIN
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
        with self._audio_lock:
            draining_audio = [t for s, t in self._audio if s is seq and t is not seq.turn]
        for t in draining_audio:
            self._end_turn(seq, t, FinishReason.CANCELLED)
        if seq.queued_turn is not None:
            t, seq.queued_turn = seq.queued_turn, None
            t.finished = FinishReason.CANCELLED
            self._end_turn(seq, t, FinishReason.CANCELLED)
        turn = seq.turn
        if turn is None or turn.finished is not None:
            return
        if seq.state is SeqState.DECODING:
            with self._decode_ctx():
                self.runner.leave(seq.slot)  # type: ignore[arg-type]
            seq.draining = True
            seq.leave_step = self._k  # steps launched before this may still produce a row
            turn.finished = FinishReason.CANCELLED
            self._end_turn(seq, turn, FinishReason.CANCELLED)
            self._maybe_drained(seq)
            return
        # TURN_PREFILL: nothing was spoken; roll the cache back as if it never happened
        turn.cancelled = True
        self._rollback(seq, turn)
        turn.finished = FinishReason.CANCELLED
        seq.turn = None
        seq.state = SeqState.IDLE
        self._end_turn(seq, turn, FinishReason.CANCELLED)

    def _abort_decoding(self, seq: Sequence, turn: Turn) -> None:
        """Take a turn that already reported its end (an error) off the device batch."""
        if seq.decoding is turn and seq.state is SeqState.DECODING and not seq.draining:
            with self._decode_ctx():
                self.runner.leave(seq.slot)  # type: ignore[arg-type]
            seq.draining, seq.leave_step = True, self._k
            self._maybe_drained(seq)

    def _rollback(self, seq: Sequence, turn: Turn) -> None:
        seq.pos = seq.turn_start_pos
        seq.closed_turn = not turn.closes_previous
        seq.needs_rebuild = seq.pos == 0

    def _close(self, seq: Sequence) -> None:
        if seq.state is SeqState.CLOSED:
            return
        for t in (seq.turn, seq.queued_turn):
            if t is not None and t.finished is None:
                self._end_turn(seq, t, FinishReason.CANCELLED, notify=False)
        seq.queued_turn = None
        self._live.pop(seq.seq_id, None)
        if seq in self._waiting:  # it never got a slot: it must not hold a place in the queue
            self._waiting.remove(seq)
        on_device = seq.state is SeqState.DECODING or seq.draining
        seq.state = SeqState.CLOSED
        if seq.slot is not None:
            if on_device:  # release the slot only once no launched step can write to it
                with self._decode_ctx():
                    self.runner.leave(seq.slot)
                if not seq.draining:
                    seq.draining, seq.leave_step = True, self._k
                self._maybe_drained(seq)
            else:
                self._release(seq)
        self._assign_slots()

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._owner.pop(seq.slot, None)
            self.runner.cache.release(seq.slot)
            seq.slot = None

    # ================================================================ prefill
    def _prefill_inline(self) -> bool:
        """Sync mode: one batched chunk of the queued prefill jobs."""
        if not self._prefill_jobs:
            return False
        jobs = list(self._prefill_jobs)[: self.cfg.prefill_batch]
        for job in self._prefill_on_stream(jobs):
            self._prefill_jobs.remove(job)
            self._complete_prefill(job)
        return True

    def _prefill_on_stream(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """One prefill round on the prefill stream; each finished job carries the event the
        decode stream must wait for before its sequence joins (a graph replay returns before
        the GPU is done: without the event the next decode step could read a half-written
        prompt)."""
        with self._on(self.prefill_stream):
            finished = self._prefill_round_safe(jobs)
            if finished and self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.prefill_stream)
                for job in finished:
                    if job.event is None:
                        job.event = ev
        return finished

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
            batch = active[: self.cfg.prefill_batch]
            try:
                finished = self._prefill_on_stream(batch)
            except Exception as e:  # outside the per-job handling (e.g. recording the event):
                log.exception("prefill round failed")  # fail this batch, keep the thread
                for job in batch:
                    job.event = e
                finished = batch
            for job in finished:
                active.remove(job)
                self._prefill_out.put(job)
            if finished:
                self._wake.set()

    def _prefill_round_safe(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """`_prefill_round`, but a failure fails only the job that causes it: a failed batch
        is retried one job at a time; a job that fails alone gets the exception as its
        `event` (its sequence is then closed with an error) and counts as finished."""
        try:
            return self._prefill_round(jobs)
        except Exception as e:
            if len(jobs) == 1:
                log.exception("prefill failed for sequence %d", jobs[0].seq.seq_id)
                jobs[0].event = e
                return jobs
            log.warning("batched prefill of %d sequences failed (%s); retrying one by one",
                        len(jobs), e)
            done: list[PrefillJob] = []
            for job in jobs:
                done += self._prefill_round_safe([job])
            return done

    def _prefill_round(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """One chunk of each job, all in one batched forward; returns the jobs now complete
        (or abandoned: closed sequence, cancelled turn)."""
        n = self.cfg.prefill_chunk
        done, items, work = [], [], []
        for job in jobs:
            seq = job.seq
            if seq.state is SeqState.CLOSED or (job.turn is not None and job.turn.cancelled):
                done.append(job)
                continue
            chunk = job.cols[:, job.done: job.done + n]
            if not chunk.shape[1]:
                done.append(job)
                continue
            items.append((job.slot, chunk, job.start + job.done))
            work.append((job, chunk.shape[1]))
        if items:
            t0 = time.perf_counter()
            replays, eager = self.prefill_graphs.plan(items)  # graphs where a bucket fits
            for key, chunks in replays:
                self.prefill_graphs.replay(key, chunks)
            if eager:
                self.runner.prefill_batch(eager)  # type: ignore[arg-type]
            dt = time.perf_counter() - t0
            self.stats["prefill_s"] += dt
            self.stats["prefill_calls"] += 1
            for job, cols in work:
                job.done += cols
                job.seq.prefill_s += dt
                self.stats["prefill_cols"] += cols
                if job.done >= job.cols.shape[1]:
                    done.append(job)
        return done

    def _apply_prefill_completions(self) -> bool:
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
            self._prefill_landing.append(job)
        if not self._prefill_landing:  # the usual case, once per decode-loop iteration
            return False
        done: list[PrefillJob] = []
        landing: list[PrefillJob] = []
        for j in self._prefill_landing:
            # an Exception (failed prefill) or None (CPU) is done; a CUDA event when it says so
            (landing if hasattr(j.event, "query") and not j.event.query() else done).append(j)
        self._prefill_landing = landing
        self._prefill_outstanding -= len(done)
        if self._prefill_outstanding < 0:  # every job is counted when queued: a bug if seen
            log.warning("prefill bookkeeping: %d more jobs landed than were queued",
                        -self._prefill_outstanding)
            self._prefill_outstanding = 0
        for job in done:  # one job's failure must not strand the others (they left the list)
            try:
                self._complete_prefill(job)
            except Exception as e:
                log.exception("joining sequence %d after its prefill failed", job.seq.seq_id)
                self._fail_sequence(job.seq, f"joining after prefill failed: {e}")
        return bool(done)

    def _fail_sequence(self, seq: Sequence, message: str) -> None:
        """Tell the sink and close the sequence (its slot goes back), whatever state it is in."""
        if seq.state is SeqState.CLOSED:
            return
        try:
            seq.sink.on_error(seq, message)
            self._close(seq)
        except Exception:
            log.exception("closing failed sequence %d failed too", seq.seq_id)

    def _complete_prefill(self, job: PrefillJob) -> None:
        if isinstance(job.event, Exception):
            self._fail_sequence(job.seq, f"prefill failed: {job.event}")
            return
        if job.event is not None and self.decode_stream is not None:
            self.decode_stream.wait_event(job.event)  # GPU-side ordering, no host wait
        self._prefill_done(job)

    def _prefill_done(self, job: PrefillJob) -> None:
        seq = job.seq
        if seq.state is SeqState.CLOSED:
            return
        if job.turn is None:  # the voice prompt
            seq.pos = job.cols.shape[1]
            seq.state = SeqState.IDLE
            seq.sink.on_ready(seq, time.perf_counter() - seq.created_at)
            self._next_queued_turn(seq)
            return
        turn = job.turn
        if turn.cancelled or seq.turn is not turn:
            return  # cancelled while prefilling: already rolled back
        seq.pos = job.start + job.cols.shape[1]
        assert turn.cols is not None
        last = turn.cols[:, -1]
        turn.cols = None
        turn.ready_at = time.perf_counter()
        seq.state = SeqState.DECODING
        self._join(seq, last, turn)

    def _join(self, seq: Sequence, last: Tensor, turn: Turn) -> None:
        with self._decode_ctx():
            self.runner.join(seq.slot, last, seq.pos, turn.max_frames,  # type: ignore[arg-type]
                             self._turn_seed(seq))
        self._owner[seq.slot] = seq  # type: ignore[index]
        seq.decoding = turn
        with self._audio_lock:
            self._audio.append((seq, turn))

    def _turn_seed(self, seq: Sequence) -> int:
        seq.turns_started += 1
        return (seq.seed * 1_000_003 + seq.turns_started * 7919) % (2**31)

    def _next_queued_turn(self, seq: Sequence) -> None:
        if seq.queued_turn is not None and seq.state is SeqState.IDLE and not seq.draining:
            seq.turn, seq.queued_turn = seq.queued_turn, None
            self._queue_turn_prefill(seq)

    # ================================================================ decode
    @staticmethod
    def _batch_buckets(n: int) -> list[int]:
        out = [b for b in (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128) if b < n]
        return [*out, n]

    def _warm_prefill(self) -> None:
        """Compile the fused ops for prefill shapes now (one sequence, and a padded batch),
        not in the first session's voice prefill (seen: 6.6 s on the H200). Writes only into
        the scratch slot."""
        t0 = time.perf_counter()
        cols = self.prompts.system()[:, :16]
        scratch = self.runner.cache.scratch
        self.runner.prefill_batch([(scratch, cols, 0)])
        self.runner.prefill_batch([(scratch, cols, 0), (scratch, cols[:, :9], 0)])
        if self.cuda:
            torch.cuda.synchronize()
        log.info("prefill shapes warmed in %.1fs", time.perf_counter() - t0)

    def _capture_graphs(self, s: torch.cuda.Stream) -> None:
        """One graph per (batch bucket, span bucket) of the whole `runner.step`, warmed and
        captured on `s`, the stream that replays them."""
        t0 = time.perf_counter()
        r = self.runner
        saved = (r.active.clone(), r.pos.clone())
        r.active.zero_()  # capture with every row inactive: writes go to the scratch slot
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            # Warm every kernel configuration once, eagerly: fused (compiled) ops specialise
            # on the batch size, and nothing may compile or autotune inside a capture.
            for span in self._decode_spans:
                r.step(1, span)
            for b in self._batches:
                r.step(b, self._decode_spans[0])
        keys = [(b, span) for span in reversed(self._decode_spans)  # largest first
                for b in reversed(self._batches)]
        graphs = capture_graphs(s, keys, lambda key: None, lambda key, _: r.step(*key))
        self.graphs = {key: (g, out) for key, (g, _, out) in graphs.items()}
        r.active.copy_(saved[0])
        r.pos.copy_(saved[1])
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batches %s; spans %s) in %.1fs", len(self.graphs),
                 self._batches, self._decode_spans, self.capture_s)

    def _kernel_attention(self) -> bool:
        """Whether every decode attention (slow and fast AR) runs the csrc kernel."""
        from . import kernels

        return self.cuda and all(
            kernels.decode_attention_supports(c.head_dim, c.n_head, c.n_local_heads)
            for c in (self.model_cfg.slow, self.model_cfg.fast))

    def _launch(self) -> _Pending | None:
        """Queue one decode step for every slot that may be active; copy its result to a
        pinned buffer without waiting for it."""
        if not self._owner:
            return None
        top = max(self._owner) + 1
        B = self._batches[bisect.bisect_left(self._batches, top)]
        # the device may be one step ahead of what the host has read: +2 covers it
        need = max(s.pos for s in self._owner.values()) + 2
        si = bisect.bisect_left(self._decode_spans, need)
        span = self._decode_spans[min(si, len(self._decode_spans) - 1)]
        t0 = time.perf_counter()
        with self._decode_ctx():
            ev_start = None
            if self.measure_gaps and self.cuda:
                ev_start = torch.cuda.Event(enable_timing=True)
                ev_start.record()
            if self.graphs is not None:
                g, out = self.graphs[(B, span)]
                g.replay()
            else:
                out = self.runner.step(B, span)
            buf = self._bufs[self._k % 2]
            buf[:B].copy_(out, non_blocking=self.cuda)
            ev = self._events[self._k % 2]
            if ev is not None:
                ev.record()
            if ev_start is not None:
                ev_end = torch.cuda.Event(enable_timing=True)
                ev_end.record()
                self.gaps.starts.append(ev_start)
                self.gaps.ends.append(ev_end)
        pend = _Pending(self._k, B, buf, ev, t0)
        self._k += 1
        self.stats["steps"] += 1
        return pend

    def _process(self, pend: _Pending) -> None:
        """Read a finished step's result and hand its frames to the sequences."""
        if pend.event is not None:
            self._device_wait["decode"] = time.perf_counter()
            try:
                pend.event.synchronize()
            finally:
                self._device_wait["decode"] = None
        out = pend.buf[: pend.B].clone()
        self.stats["decode_s"] += time.perf_counter() - pend.t_launch
        self._processed = pend.k
        K1 = self.model_cfg.frame_rows
        im_end = self.model_cfg.ids.im_end
        rows = out.tolist()
        appended = False
        for slot, seq in list(self._owner.items()):
            if slot >= pend.B:
                continue
            row = rows[slot]
            if not row[K1]:  # was not active in that step
                if not seq.draining and seq.state is not SeqState.DECODING:
                    self._owner.pop(slot, None)
                continue
            seq.pos += 1
            turn = seq.decoding
            if turn is None:
                continue
            frame = out[slot, :K1]  # a view of this step's (cloned) result
            turn.all_frames.append(frame)
            if seq.draining or turn.finished is not None:
                self.stats["wasted_rows"] += 1
                continue
            self.stats["frames"] += 1
            if row[0] == im_end:
                turn.all_frames.pop()
                self._generation_ended(seq, turn, FinishReason.EOS)
                continue
            turn.frames.append(frame)
            appended = True
            if row[K1 + 1]:
                self._generation_ended(seq, turn, FinishReason.LENGTH)
        for seq in [s for s in self._owner.values() if s.draining]:
            self._maybe_drained(seq)
        if appended:
            self._codec_wake.set()

    def _generation_ended(self, seq: Sequence, turn: Turn, reason: FinishReason) -> None:
        """EOS / LENGTH: the GPU already stopped the slot; audio drains through the codec."""
        turn.finished = reason  # read by the codec thread after the last frame was appended
        self._owner.pop(seq.slot, None)  # type: ignore[arg-type]
        self._record_history(seq, turn, reason)
        seq.turn = None
        seq.decoding = None
        seq.state = SeqState.IDLE
        self._next_queued_turn(seq)

    def _maybe_drained(self, seq: Sequence) -> None:
        if not seq.draining or self._processed < seq.leave_step - 1:
            return
        turn = seq.decoding
        seq.draining = False
        seq.decoding = None
        self._owner.pop(seq.slot, None)  # type: ignore[arg-type]
        seq.turn = None
        if seq.state is SeqState.CLOSED:
            self._release(seq)
            self._assign_slots()
            return
        if turn is not None:
            self._record_history(seq, turn, FinishReason.CANCELLED)
        seq.state = SeqState.IDLE
        self._next_queued_turn(seq)

    def _record_history(self, seq: Sequence, turn: Turn, reason: FinishReason) -> None:
        # Frames fed back into the cache form the assistant turn: all of them after an EOS
        # (the <|im_end|> frame itself is not fed), all but the last otherwise.
        frames = turn.all_frames
        n_fed = len(frames) if reason is FinishReason.EOS else max(0, len(frames) - 1)
        codes = (torch.stack(frames[:n_fed], 1)[1:] if n_fed
                 else torch.zeros(self.model_cfg.num_codebooks, 0, dtype=torch.long))
        seq.history.append((turn.text, codes))
        seq.closed_turn = False

    # ================================================================ endings
    def _fail_turn(self, seq: Sequence, turn: Turn, message: str, code: str = "internal") -> None:
        turn.finished = FinishReason.ERROR
        self._end_turn(seq, turn, FinishReason.ERROR, error=message, code=code)

    def _end_turn(self, seq: Sequence, turn: Turn, reason: FinishReason, *, error: str | None = None,
                  code: str | None = None, notify: bool = True) -> None:
        """Report a turn's end now (cancel, error): no audio of it is emitted afterwards."""
        with self._emit_lock:
            turn.cancelled = True
            turn.finished = reason
            if notify and not turn.reported:
                turn.reported = True
                if reason is FinishReason.ERROR and code is None:
                    code = "internal"
                seq.sink.on_turn_end(seq, self._result(turn, reason, error, code))

    def _result(self, turn: Turn, reason: FinishReason, error: str | None = None,
                code: str | None = None) -> TurnResult:
        frames = len(turn.frames)
        codes = torch.stack(turn.frames, 1)[1:] if frames else None
        return TurnResult(turn.turn_id, reason, frames, turn.samples_out / self.sample_rate,
                          turn.submitted_at, turn.ready_at, turn.first_audio_at,
                          time.perf_counter(), codes=codes, error=error, error_code=code)

    # ================================================================ decode thread
    def _decode_loop(self) -> None:
        torch.set_grad_enabled(False)
        pending: _Pending | None = None
        while not self._stop.is_set():
            try:
                did = self._drain_commands()
                did |= self._apply_prefill_completions()
                launched = self._launch_or_pause()
                if pending is not None:
                    self._process(pending)  # step N-1, while step N runs on the GPU
                    did = True
                pending = launched
                if launched is not None:
                    did = True
            except Exception:
                log.exception("decode loop iteration failed")
                pending, did = None, False
                self._fail_all_decoding("decode step failed (see server log)")
            if not did:
                # a prefill still on the GPU is polled often: its sequence joins (and its
                # TTFA clock runs) as soon as it lands; a paused batch resumes in time
                self._wake.wait(timeout=0.0005 if self._prefill_landing
                                else 0.002 if self._prefill_outstanding else 0.02)
                self._wake.clear()

    def _launch_or_pause(self) -> _Pending | None:
        """The decode thread's launch: the next step, or none while the batch pauses for
        prefills (counted, and timed, in stats)."""
        launched = None
        if self._owner:
            now = time.perf_counter()
            if not self._yield_to_prefill(now):
                launched = self._launch()
            elif self._paused_at is None:  # a pause starts
                self._paused_at = now
                self.stats["decode_pauses"] += 1
        if self._paused_at is not None and (launched is not None or not self._owner):
            self.stats["decode_paused_s"] += time.perf_counter() - self._paused_at
            self._paused_at = None  # the pause ended: a step went, or nothing runs
        self._note_launch(launched)
        return launched

    def _note_launch(self, pend: _Pending | None) -> None:
        """Time back-to-back step launches (the decode rate every running stream gets); a
        pass without a launch (idle, paused) breaks the chain."""
        if pend is None:
            self._last_launch = None
            return
        if self._last_launch is not None:
            dt = pend.t_launch - self._last_launch
            self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
        self._last_launch = pend.t_launch

    def _first_chunk(self) -> int:
        """Frames in a turn's first audio chunk now: twice first_chunk_frames while the
        streams generate slower than slow_start_x times realtime (EngineConfig)."""
        first, step_s = self.cfg.first_chunk_frames, self._step_s  # step_s: the decode thread's
        if self.cfg.slow_start_x and step_s is not None \
                and step_s * self.frame_rate * self.cfg.slow_start_x > 1.0:
            return 2 * first
        return first

    def _yield_to_prefill(self, now: float) -> bool:
        """Prefill first: whether the next decode step waits because prompts are
        prefilling and no running turn needs a frame yet (EngineConfig.prefill_first_*).
        LLM servers run a prefill batch alone for the same reason: sharing the GPU with
        decode steps and codec ticks, 64 turns submitted at once spent 166 ms p50 in
        prefill (H200, docs/PERF.md) for ~75 ms of replays on an idle GPU."""
        if not self._prefill_outstanding or self.cfg.prefill_first_lead_s == 0:
            return False
        first = self._first_chunk()
        for seq in self._owner.values():
            turn = seq.decoding
            # a draining (cancelled) turn needs no new step: reading the one in flight frees it
            if seq.draining or turn is None or turn.finished is not None:
                continue
            n = len(turn.frames)
            if n < first:  # joined, first chunk not generated yet: waits a bounded time
                if turn.ready_at is None or now - turn.ready_at >= self.cfg.prefill_first_wait_s:
                    return False
                continue
            start = turn.first_audio_at  # set by the codec thread; None: first chunk in flight
            if start is not None and n / self.frame_rate - (now - start) < self.cfg.prefill_first_lead_s:
                return False
        return True

    def _fail_all_decoding(self, message: str) -> None:
        for slot, seq in list(self._owner.items()):
            self._owner.pop(slot, None)
            turn = seq.decoding
            if turn is not None and turn.finished is None:
                self._end_turn(seq, turn, FinishReason.ERROR, error=message)
            seq.decoding = seq.turn = None
            seq.draining = False
            seq.needs_rebuild = True
            if seq.state is not SeqState.CLOSED:
                seq.state = SeqState.IDLE
            if seq.slot is not None:
                with self._decode_ctx():
                    self.runner.leave(seq.slot)
                if seq.state is SeqState.CLOSED:
                    self._release(seq)

    # ================================================================ codec
    def _codec_loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                with self._on(self.codec_stream):
                    did = self._codec_tick()
            except Exception:
                log.exception("codec tick failed")
                did = False
            if not did:
                self._codec_wake.wait(timeout=0.01)
                self._codec_wake.clear()

    def _codec_tick(self) -> bool:
        """Decode the pending frames of every turn that has a chunk's worth, in one batch."""
        ripe, ended, due = self._codec_candidates()
        for s, turn in ended:
            self._finish_audio(s, turn)
        if not due:  # every ripe stream is far enough ahead: wait for a fuller tick
            return bool(ended)
        work: dict[int, tuple[Sequence, Turn, Tensor]] = {}
        for s, turn, pending in ripe:
            if turn.codec_stream is None:
                turn.codec_stream = self.decoder.open()
            codes = torch.stack(turn.frames[turn.decoded_frames: turn.decoded_frames + pending],
                                dim=1)[1:]  # [K, n]
            work[turn.codec_stream] = (s, turn, codes)
        t0 = time.perf_counter()
        try:
            if self.cuda:  # on a CPU the codec's wait is its own compute, not a stall
                self._device_wait["codec"] = t0
            out = self.decoder.decode({sid: c for sid, (_, _, c) in work.items()})
            # one device->host copy for the whole tick, then split per stream
            flat = torch.cat([out[sid] for sid in work]).cpu().numpy()  # decode gives float32
            self._device_wait["codec"] = None
            host, at = {}, 0
            for sid in work:
                n = out[sid].shape[0]
                host[sid], at = flat[at: at + n], at + n
        except Exception as e:  # the turns of this tick end with an error; the loop goes on
            self._device_wait["codec"] = None
            log.exception("codec decode failed for %d streams", len(work))
            for s, turn, _ in work.values():
                self._drop_audio(s, turn)
                self._end_turn(s, turn, FinishReason.ERROR, error=f"audio decoding failed: {e}")
                self._post(lambda s=s, turn=turn: self._abort_decoding(s, turn))
            return True
        self.stats["codec_s"] += time.perf_counter() - t0
        self.stats["codec_ticks"] += 1
        for sid, (s, turn, codes) in work.items():
            pcm: np.ndarray = host[sid]
            with self._emit_lock:
                if turn.cancelled:
                    continue
                offset = turn.samples_out / self.sample_rate
                turn.decoded_frames += codes.shape[1]
                turn.samples_out += len(pcm)
                if turn.first_audio_at is None:
                    turn.first_audio_at = time.perf_counter()
                s.sink.on_audio(s, turn.turn_id, pcm, offset)
            if turn.finished is not None and turn.decoded_frames == len(turn.frames):
                self._finish_audio(s, turn)
        return True

    def _codec_candidates(self) -> tuple[list[tuple[Sequence, Turn, int]],
                                         list[tuple[Sequence, Turn]], bool]:
        """The streams with a chunk's worth of frames (and how many frames), the turns whose
        audio is complete, and whether any ripe stream needs a tick now."""
        ripe: list[tuple[Sequence, Turn, int]] = []
        ended: list[tuple[Sequence, Turn]] = []
        due, now, first = False, time.perf_counter(), self._first_chunk()
        with self._audio_lock:
            audio = list(self._audio)
        for s, turn in audio:
            if turn.cancelled:
                self._drop_audio(s, turn)
                continue
            finished = turn.finished is not None  # read before the frame count (see _process)
            pending = len(turn.frames) - turn.decoded_frames
            if finished and pending == 0:
                ended.append((s, turn))
                continue
            # Chunks grow 1, 1, 2, 4, 8, 8…: a small first chunk for TTFA, then doubling, so
            # the listener's buffer is topped up before it drains, then full-size chunks.
            need = min(self.cfg.chunk_frames, max(first, turn.decoded_frames))
            if pending == 0 or (pending < need and not finished):
                continue
            due |= finished or self._codec_due(turn, pending, now)
            ripe.append((s, turn, pending))
        return ripe, ended, due

    def _codec_due(self, turn: Turn, pending: int, now: float) -> bool:
        """Whether a stream with a chunk's worth of frames needs a tick now. One that is
        more than `codec_hold_s` of audio ahead of realtime playback can wait: it rides
        along in the next tick another stream needs, or goes once it has two chunks
        pending — fewer, fuller ticks (each costs ~3 ms however few streams it carries).
        First chunks never wait (TTFA)."""
        if self.cfg.codec_hold_s == 0 or turn.decoded_frames < self.cfg.chunk_frames \
                or pending >= 2 * self.cfg.chunk_frames or turn.first_audio_at is None:
            return True
        ahead = turn.samples_out / self.sample_rate - (now - turn.first_audio_at)
        return ahead < self.cfg.codec_hold_s

    def _drop_audio(self, seq: Sequence, turn: Turn) -> None:
        with self._audio_lock:
            self._audio = [(s, t) for s, t in self._audio if t is not turn]
        if turn.codec_stream is not None:
            self.decoder.close(turn.codec_stream)
            turn.codec_stream = None

    def _finish_audio(self, seq: Sequence, turn: Turn) -> None:
        self._drop_audio(seq, turn)
        with self._emit_lock:
            if not turn.reported and not turn.cancelled:
                turn.reported = True
                seq.sink.on_turn_end(seq, self._result(turn, turn.finished or FinishReason.ERROR))

    # ================================================================ measurements
    def gpu_idle_gaps_ms(self) -> list[float]:
        """Idle time between consecutive measured steps (needs `measure_gaps = True`)."""
        torch.cuda.synchronize()
        gaps = [self.gaps.ends[i].elapsed_time(self.gaps.starts[i + 1])
                for i in range(len(self.gaps.starts) - 1)]
        self.gaps = _Gaps()
        return gaps


def build_engine(bundle: Bundle, config: EngineConfig | None = None) -> Engine:
    """An engine over a loaded bundle (model, tokenizer, codec)."""
    cfg = config or EngineConfig()
    model = bundle.model
    device = model.embeddings.weight.device
    n_slots = cfg.max_running
    if device.type == "cuda":  # size the cache from the memory left after the weights
        if cfg.fused_ops in ("auto", "compile"):
            from . import fusion

            fusion.pack_ffn(model)  # the engine would pack W1|W3 later: its copies first
        gc.collect()  # an earlier engine waiting for the cycle collector still holds memory
        torch.cuda.empty_cache()  # cached, unused blocks (weight loading) count as free
        free, _ = torch.cuda.mem_get_info(device)
        slot = SlowKVCache.slot_bytes(model.cfg.slow, cfg.max_len, model.embeddings.weight.dtype)
        n_slots = fit_kv_slots(cfg.max_running, free_bytes=free, slot_bytes=slot,
                               reserve_bytes=int(cfg.kv_reserve_gib * 2**30), max_len=cfg.max_len)
        if n_slots < cfg.max_running:
            log.warning("KV cache: %d of the %d requested slots fit in GPU memory (%.1f GiB free, "
                        "%.1f GiB reserved, %.0f MiB per slot of %d positions); sessions beyond "
                        "that wait for a slot", n_slots, cfg.max_running, free / 2**30,
                        cfg.kv_reserve_gib, slot / 2**20, cfg.max_len)
    runner = ModelRunner(model, n_slots=n_slots, max_len=cfg.max_len)
    return Engine(runner, bundle.tokenizer, bundle.codec, cfg)


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
