"""The decode thread's device side: the scheduler's row updates, step launches (a CUDA graph
replay per step) whose results are copied into pinned ping/pong buffers without waiting,
and reading a launched step's result once its event says it is done.

Pingpong: the decode thread launches step N, then reads step N-1 from the other buffer
while step N runs, so the GPU always has the next step queued and the host never waits on
the step it just launched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .capture import bucket, buckets, on_stream
from .request import RowOp
from .runner import ModelRunner
from .scheduler import StepPlan

BATCH_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


@dataclass(slots=True)
class Launched:
    """A launched decode step whose result has not been read yet."""

    k: int
    B: int  # the batch bucket it ran at
    buf: Tensor  # [B, 1+K+2] pinned host buffer its result is copied into
    event: object | None  # recorded after the copy (CUDA), None on a CPU
    t_launch: float = 0.0


@dataclass(slots=True)
class _Gaps:
    """GPU idle time between consecutive decode steps, from CUDA events."""

    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)


class DecodeWorker:
    def __init__(self, runner: ModelRunner, stream: torch.cuda.Stream | None, *, span_step: int,
                 stats: dict[str, float], one_row: bool = False) -> None:
        self.runner = runner
        self.stream = stream
        self.stats = stats
        self.cuda = runner.device.type == "cuda"
        # With compiled (fused) ops the smallest bucket is 2 rows: dynamo traces each op once
        # more for a batch of exactly 1 (it specialises sizes 0 and 1), at every start (tiny
        # model: 13 decode-shape traces with it, 7 without; on the H200 ~0.6 s each before
        # ready), and a lone turn pays for it only a second, inactive row (the bf16 linear
        # table: M=2 within 0.2-3 % of M=1 for every S2-Pro shape; the whole step 2 % slower
        # in FP8: 4.17 against 4.09 ms). `one_row` (EngineConfig.one_row_bucket) keeps it.
        ladder = (BATCH_LADDER[1:] if runner.ops.fused == "compile" and not one_row
                  else BATCH_LADDER)
        self.batches = buckets(ladder, runner.n_rows)
        # Span buckets bound the keys the decode step's torch attention reads; csrc's
        # decode_attention reads exactly 0..pos, so with it one span serves every step.
        max_len = runner.max_len
        self.spans = ([max_len] if runner.attention_kernel
                      else buckets(range(span_step, max_len, span_step), max_len))
        W = runner.out_width
        self._bufs = [torch.zeros(runner.n_rows + 1, W, dtype=torch.long, pin_memory=self.cuda)
                      for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self.waiting_since: float | None = None  # a read waiting on the device (watchdog)
        self.measure_gaps = False
        self.gaps = _Gaps()

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch, span) bucket's graph key, largest first."""
        return [(b, span) for span in reversed(self.spans) for b in reversed(self.batches)]

    def warm(self) -> float:
        """Run every bucket's step once, eagerly, on this worker's stream (before any
        capture: fused ops compile for the batch sizes here, not in a live step)."""
        assert self.stream is not None
        return self.runner.warm_steps(self.stream, self.batches, self.spans)

    def capture(self, keys: list[tuple[int, int]]) -> float:
        """Capture the step for `keys` on this worker's stream (after `warm`), each put in
        use; on the thread that launches steps, between steps (rows are set inactive
        meanwhile)."""
        assert self.stream is not None
        return self.runner.capture_steps(self.stream, keys)

    @property
    def graphs(self) -> int:
        return len(self.runner.step_graphs)

    def apply(self, ops: list[RowOp]) -> list[tuple[RowOp, Exception]]:
        """The scheduler's row updates, on the decode stream: they land between two steps,
        in launch order (a write on another stream could race a step in flight and be
        overwritten by it). An op that fails is returned with its error (the others are
        applied): only its sequence is affected."""
        failed: list[tuple[RowOp, Exception]] = []
        if ops:
            with on_stream(self.stream):
                for op in ops:
                    try:
                        self.runner.apply(op)
                    except Exception as e:
                        failed.append((op, e))
        return failed

    def settle(self) -> None:
        """Wait until every step queued on the decode stream has finished (after a failure:
        a launched step whose result will never be read still writes KV). A device that
        fails again here is left to the watchdog."""
        if self.stream is None:
            return
        try:
            self.stream.synchronize()
        except Exception:  # the device itself failed: nothing more to wait for
            pass

    def wait_for(self, event: object) -> None:
        """Later steps wait (on the GPU, not the host) for a prefill round's event."""
        if self.stream is not None and isinstance(event, torch.cuda.Event):
            self.stream.wait_event(event)

    def launch(self, plan: StepPlan) -> Launched:
        """Queue the planned step and a non-blocking copy of its result; never waits."""
        B = bucket(self.batches, plan.B)
        assert B is not None, f"batch {plan.B} over the engine's {self.runner.n_rows} rows"
        span = bucket(self.spans, plan.span) or self.spans[-1]
        with on_stream(self.stream):
            ev_start = None
            if self.measure_gaps and self.cuda:
                ev_start = torch.cuda.Event(enable_timing=True)
                ev_start.record()
            out = self.runner.launch(B, span)
            buf = self._bufs[plan.k % 2]
            buf[:B].copy_(out, non_blocking=self.cuda)
            ev = self._events[plan.k % 2]
            if ev is not None:
                ev.record()
            if ev_start is not None:
                ev_end = torch.cuda.Event(enable_timing=True)
                ev_end.record()
                self.gaps.starts.append(ev_start)
                self.gaps.ends.append(ev_end)
        return Launched(plan.k, B, buf, ev, plan.t_launch)

    def read(self, step: Launched) -> Tensor:
        """The step's result on the host [B, 1+K+2], once the GPU is done with it."""
        if step.event is not None:
            self.waiting_since = time.perf_counter()
            try:
                step.event.synchronize()  # type: ignore[attr-defined]
            finally:
                self.waiting_since = None
        out = step.buf[: step.B].clone()
        self.stats["decode_s"] += time.perf_counter() - step.t_launch
        return out

    def idle_gaps_ms(self) -> list[float]:
        """Idle time between consecutive measured steps (needs `measure_gaps = True`)."""
        torch.cuda.synchronize()
        gaps = [self.gaps.ends[i].elapsed_time(self.gaps.starts[i + 1])
                for i in range(len(self.gaps.starts) - 1)]
        self.gaps = _Gaps()
        return gaps
