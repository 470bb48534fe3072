"""The model runner: owns the weights, the KV cache and all per-slot decode state on the
device, and runs the two kinds of work the engine schedules, with the speed-ups the
engine's `Ops` and CUDA graphs give them.

- `prefill*`: write a chunk of prompt columns into a slot's cache.
- `step(B, span)`: one audio frame for every slot row 0..B-1 ("dense" batch: row i is slot
  i, so a slot's keys are read in place, never gathered). Rows whose slot is not active
  compute garbage that is discarded on the device, and write into the scratch slot. The step
  reads and updates only device state (the column to feed, position, frame budget, the
  active flag, the sampler's window), so consecutive steps need no host round trip: it is
  captured as one CUDA graph per (batch, span) bucket (`capture_steps`) and replayed back
  to back (`launch`). The host learns what happened from the returned `[B, 1+K+2]` tensor
  (frame, was-active, stopped), whenever it gets to it.
- `apply(op)`: a slot update the scheduler decided (`SlotOp`), written on the caller's
  stream so that it lands between two steps.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from . import staging
from .cache import (
    BatchedPrefillAttend,
    DenseDecodeAttend,
    FastKV,
    PrefillAttend,
    SlotPrefillAttend,
    SlowKVCache,
)
from .capture import capture_graphs
from .config import ModelConfig, TransformerConfig
from .kernels.decode_attention import supports as kernel_supports
from .model import DualAR
from .ops import REFERENCE, Ops
from .request import SlotOp
from .sampler import SamplingParams, SlotSampling

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: DualAR, *, n_slots: int, max_len: int, ops: Ops = REFERENCE,
                 dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.ops = ops
        self.cfg: ModelConfig = model.cfg
        self.device = model.embeddings.weight.device
        self.dtype = dtype or model.embeddings.weight.dtype
        self.n_slots = n_slots
        self.cache = SlowKVCache(self.cfg.slow, n_slots, max_len, device=self.device,
                                 dtype=self.dtype)
        S, d = n_slots + 1, self.device  # + the scratch row
        self.sampling = SlotSampling(S, d, draw=ops.sample, shift=ops.shift_window)
        self.slow_kernel = self._attention_kernel(self.cfg.slow)
        self.fast_kv = FastKV(self.cfg, S, device=d, dtype=self.dtype,
                              kernel=self._attention_kernel(self.cfg.fast))
        self.n_semantic = self.cfg.ids.n_semantic
        # Per-slot decode state, device-resident.
        self.next_col = torch.zeros(S, self.cfg.frame_rows, dtype=torch.long, device=d)
        self.pos = torch.zeros(S, dtype=torch.long, device=d)
        self.frames_left = torch.zeros(S, dtype=torch.long, device=d)
        self.active = torch.zeros(S, dtype=torch.bool, device=d)
        self.row_ids = torch.arange(S, device=d)
        self.step_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    @property
    def out_width(self) -> int:
        return self.cfg.frame_rows + 2

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def scratch(self) -> int:
        return self.cache.scratch

    def _attention_kernel(self, c: TransformerConfig):  # type: ignore[no-untyped-def]
        """The ops' one-position attention kernel where it handles this stack's heads."""
        k = self.ops.decode_attention
        if k is None or self.device.type != "cuda" \
                or not kernel_supports(c.head_dim, c.n_head, c.n_local_heads):
            return None
        return k

    @property
    def attention_kernel(self) -> bool:
        """Whether every decode attention (slow and fast AR) runs the csrc kernel, which reads
        exactly positions 0..pos: the decode graphs then need one span bucket only."""
        return self.slow_kernel is not None and self.fast_kv.kernel is not None

    # ------------------------------------------------------------------ host -> device
    def apply(self, op: SlotOp) -> None:
        """A slot update the scheduler decided, on the current stream."""
        if op.kind == "assign":
            assert op.params is not None
            self.assign(op.slot, op.params, op.seed)
        elif op.kind == "join":
            assert op.col is not None
            self.join(op.slot, op.col, op.pos, op.max_frames, op.seed)
        elif op.kind == "leave":
            self.leave(op.slot)
        else:
            raise ValueError(f"unknown slot op {op.kind!r}")

    def assign(self, slot: int, params: SamplingParams, seed: int) -> None:
        """A new sequence in `slot`: its sampling parameters and seed."""
        self.sampling.assign(slot, params, seed)

    def join(self, slot: int, col: Tensor, pos: int, max_frames: int, seed: int) -> None:
        """Make `slot` decode from the next step on: feed `col` [1+K] at `pos`."""
        vals = staging.to_device([pos, max_frames, seed, *col.tolist()], self.device)
        self.pos[slot] = vals[0]
        self.frames_left[slot] = vals[1]
        self.sampling.begin_turn_dev(slot, vals[2])
        self.next_col[slot] = vals[3:]
        self.active[slot] = True

    def leave(self, slot: int) -> None:
        """Stop decoding `slot` from the next step on (cancel)."""
        self.active[slot] = False

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, slot: int, cols: Tensor, start: int) -> Tensor:
        """cols: [1+K, T] prompt columns placed at positions start..start+T-1.
        Returns the final-normed hidden state of the last column [D]."""
        cols = cols.to(self.device, non_blocking=True)
        T = cols.shape[1]
        attend = PrefillAttend(self.cache, slot, start, T)
        positions = torch.arange(start, start + T, device=self.device)[None]
        h = self.model.forward_slow(cols[None], positions, attend, self.ops)
        return h[0, -1]

    @torch.inference_mode()
    def prefill_batch(self, items: list[tuple[int, Tensor, int]]) -> None:
        """Several prefills in one forward: items of (slot, cols [1+K, n], start)."""
        if len(items) == 1:
            slot, cols, start = items[0]
            self.prefill(slot, cols, start)
            return
        T = max(c.shape[1] for _, c, _ in items)
        batch = torch.zeros(len(items), self.cfg.frame_rows, T, dtype=torch.long)
        for n, (_, c, _) in enumerate(items):
            batch[n, :, : c.shape[1]] = c
        attend = BatchedPrefillAttend(self.cache, [s for s, _, _ in items],
                                      [st for _, _, st in items],
                                      [c.shape[1] for _, c, _ in items], T)
        self.model.forward_slow(batch.to(self.device, non_blocking=True), attend.positions,
                                attend, self.ops)

    def prefill_inputs(self, T: int, N: int = 1) -> dict[str, Tensor]:
        """Device buffers for `prefill_static` of N chunks of T columns (all rows on the
        scratch slot at position 0 until filled in)."""
        d = self.device
        return {"cols": torch.zeros(N, self.cfg.frame_rows, T, dtype=torch.long, device=d),
                "slot": torch.full((N,), self.cache.scratch, dtype=torch.long, device=d),
                "start": torch.zeros(N, dtype=torch.long, device=d)}

    @torch.inference_mode()
    def prefill_static(self, inp: dict[str, Tensor], span: int) -> None:
        """`prefill_batch` with every input a device tensor (`prefill_inputs`): capturable
        as one CUDA graph per (N, T, span). The caller guarantees start + T <= span <= max_len
        for every row and distinct slots for the real rows."""
        T = inp["cols"].shape[2]
        positions = inp["start"][:, None] + torch.arange(T, device=self.device)  # [N, T]
        attend = SlotPrefillAttend(self.cache, inp["slot"], positions, span)
        self.model.forward_slow(inp["cols"], positions, attend, self.ops)

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def step(self, B: int, span: int) -> Tensor:
        """One frame for slot rows 0..B-1; `span` bounds max(pos)+1 of the active rows.
        Returns out [B, 1+K+2] int64: frame [t, c0..c9], was_active, stopped."""
        was = self.active[:B].clone()
        cols, pos = self.next_col[:B], self.pos[:B]
        # inactive rows write into the scratch slot, so a slot being prefilled is never touched
        wslots = torch.where(was, self.row_ids[:B], self.n_slots)
        frames = self.decode(cols, torch.where(was, pos, 0), wslots, span)
        self.next_col[:B] = torch.where(was[:, None], frames, cols)
        self.pos[:B] += was
        self.frames_left[:B] -= was.long()
        stop = was & ((frames[:, 0] == self.cfg.ids.im_end) | (self.frames_left[:B] <= 0))
        self.active[:B] = was & ~stop
        return torch.cat([frames, was[:, None].long(), stop[:, None].long()], dim=1)

    def decode(self, cols: Tensor, positions: Tensor, wslots: Tensor, span: int) -> Tensor:
        """Rows 0..B-1 (= slots) feed cols [B, 1+K] at positions [B] -> frames [B, 1+K]."""
        B = cols.shape[0]
        attend = DenseDecodeAttend(self.cache, B, wslots, positions, span, self.slow_kernel)
        h = self.model.forward_slow(cols[:, :, None], positions[:, None], attend,
                                    self.ops)[:, 0]  # [B, D]
        return self.frame_from_hidden(h)

    def frame_from_hidden(self, h: Tensor) -> Tensor:
        """Sample one frame for rows 0..B-1 from slow hidden states h [B, D]."""
        m, ids, ops = self.model, self.cfg.ids, self.ops
        B = h.shape[0]
        rows = slice(0, B)
        idx = self.sampling.sample_main(rows, m.semantic_logits(h, ops), self.n_semantic)
        token = torch.where(idx < self.n_semantic, idx + ids.semantic_start,
                            torch.full_like(idx, ids.im_end))
        # c0 is the semantic index (0 for <|im_end|>, as the reference clamps it).
        code = torch.where(idx < self.n_semantic, idx, torch.zeros_like(idx))
        fkv = self.fast_kv
        # position 0: the slow hidden state; output unused
        m.forward_fast(h[:, None], 0, fkv.at(0, B), ops)
        codes = [code]
        for j in range(1, self.cfg.num_codebooks):
            logits = m.forward_fast(m.fast_embeddings(code)[:, None], j, fkv.at(j, B), ops)
            code = self.sampling.sample_fast(rows, logits, j)
            codes.append(code)
        self.sampling.advance(rows)
        return torch.stack([token, *codes], dim=1)

    # ------------------------------------------------------------------ decode graphs
    def capture_steps(self, stream: torch.cuda.Stream, batches: list[int],
                      spans: list[int]) -> float:
        """One CUDA graph per (batch bucket, span bucket) of the whole `step`, warmed and
        captured on `stream` (the stream that replays them) with every row inactive: its
        writes go to the scratch slot, and no slot's state changes. Returns the seconds."""
        t0 = time.perf_counter()
        saved = (self.active.clone(), self.pos.clone())
        self.active.zero_()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Warm every kernel configuration once, eagerly: fused (compiled) ops specialise
            # on the batch size, and nothing may compile or autotune inside a capture.
            for span in spans:
                self.step(1, span)
            for b in batches:
                self.step(b, spans[0])
        keys = [(b, span) for span in reversed(spans) for b in reversed(batches)]  # largest first
        graphs = capture_graphs(stream, keys, lambda key: None, lambda key, _: self.step(*key))
        self.step_graphs = {key: (g, out) for key, (g, _, out) in graphs.items()}
        self.active.copy_(saved[0])
        self.pos.copy_(saved[1])
        return time.perf_counter() - t0

    def launch(self, B: int, span: int) -> Tensor:
        """Queue one step of rows 0..B-1 over keys [0, span): a graph replay where one was
        captured (B and span must then be buckets), else eager. Returns its output tensor
        (a graph's static output: read it before the next launch of the same key)."""
        graph = self.step_graphs.get((B, span))
        if graph is None:
            return self.step(B, span)
        g, out = graph
        g.replay()
        return out
