"""The model runner: owns the weights, the paged KV cache and all per-row decode state on
the device, and runs the kinds of work the engine schedules, with the speed-ups the
engine's `Ops` and CUDA graphs give them.

- `prefill*`: write a chunk of prompt columns into a sequence's blocks (its block table).
- `step(B, span)`: one audio frame for every decode row 0..B-1. A row is a place in the
  decode batch that a turn holds while it speaks; each row has a block table on the device
  (set when a turn joins, extended as it grows), so keys are read in place through it. Rows
  that are not active compute garbage that is discarded on the device, and write into the
  scratch block. The step reads and updates only device state (the column to feed,
  position, frame budget, the active flag, the sampler's window, the tables), so
  consecutive steps need no host round trip: it is captured as one CUDA graph per (batch,
  span) bucket (`capture_steps`) and replayed back to back (`launch`). The host learns what
  happened from the returned `[B, 1+K+2]` tensor (frame, was-active, stopped), whenever it
  gets to it.
- `apply(op)`: a row update the scheduler decided (`RowOp`), written on the caller's
  stream so that it lands between two steps.
- `save` / `restore` / `copy_block`: a sequence's blocks to host memory and back (sessions
  evicted while idle), and copy-on-write of a shared voice prefix's last block.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
from torch import Tensor

from . import staging
from .cache import (
    BatchedPrefillAttend,
    FastKV,
    PagedDecodeAttend,
    PrefillAttend,
    SlowKVCache,
    TablePrefillAttend,
)
from .capture import capture_graphs
from .config import ModelConfig, TransformerConfig
from .kernels.decode_attention import ROPE_HEAD_DIMS
from .kernels.decode_attention import supports as kernel_supports
from .kernels.decode_attention_triton import prefix_rows_per_tile
from .model import DualAR
from .ops import REFERENCE, Ops
from .request import RowOp
from .sampler import SamplingParams, SlotSampling
from .shared_prefix import SharedPrefixes

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: DualAR, *, n_rows: int, max_len: int, n_blocks: int | None = None,
                 block_size: int = 64, ops: Ops = REFERENCE,
                 dtype: torch.dtype | None = None) -> None:
        """n_rows: the decode batch's rows (max_running); n_blocks: the KV pool's blocks of
        block_size positions (default: a full context per row)."""
        self.model = model
        self.ops = ops
        self.cfg: ModelConfig = model.cfg
        self.device = model.embeddings.weight.device
        self.dtype = dtype or model.embeddings.weight.dtype
        self.n_rows = n_rows
        if n_blocks is None:
            n_blocks = n_rows * -(-max_len // block_size)
        self.cache = SlowKVCache(self.cfg.slow, n_blocks, block_size, max_len,
                                 device=self.device, dtype=self.dtype)
        S, d = n_rows + 1, self.device  # + the scratch row
        self.sampling = SlotSampling(S, d, draw=ops.sample, draw_embed=ops.sample_embed,
                                     shift=ops.shift_window, book=ops.book)
        self.slow_kernel = self._attention_kernel(self.cfg.slow)
        self.fast_kv = FastKV(self.cfg, S, device=d, dtype=self.dtype,
                              kernel=self._attention_kernel(self.cfg.fast),
                              rope_rows=self._rope_rows(self.cfg.fast, self.ops.decode_rope_fast),
                              deferred=ops.attend_kernel is not None)
        self.n_semantic = self.cfg.ids.n_semantic
        # the rows' shared voice prefixes, planned for the Triton decode attention
        slow = self.cfg.slow
        self.prefixes = (SharedPrefixes(S, block_size, prefix_rows_per_tile(
            slow.n_head, slow.n_local_heads), d) if ops.shared_prefix else None)
        # Per-row decode state, device-resident.
        self.next_col = torch.zeros(S, self.cfg.frame_rows, dtype=torch.long, device=d)
        self.pos = torch.zeros(S, dtype=torch.long, device=d)
        self.frames_left = torch.zeros(S, dtype=torch.long, device=d)
        self.active = torch.zeros(S, dtype=torch.bool, device=d)
        # each row's block table; rows not decoding point at the scratch block
        self.tables = torch.full((S, self.cache.table_width), self.cache.scratch,
                                 dtype=torch.long, device=d)
        self.step_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._step_pool: tuple[int, int] | None = None  # the step graphs' memory pool

    @property
    def out_width(self) -> int:
        return self.cfg.frame_rows + 2

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def scratch(self) -> int:
        """The scratch block."""
        return self.cache.scratch

    @property
    def n_blocks(self) -> int:
        return self.cache.n_blocks

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def _attention_kernel(self, c: TransformerConfig):  # type: ignore[no-untyped-def]
        """The ops' one-position attention kernel where it handles this stack's heads."""
        k = self.ops.decode_attention
        if k is None or self.device.type != "cuda" \
                or not kernel_supports(c.head_dim, c.n_head, c.n_local_heads):
            return None
        return k

    @staticmethod
    def _rope_rows(c: TransformerConfig, rows: int) -> int:
        """Up to how many rows this stack's decode attention kernel also does the q/k norm
        and RoPE (0: never): the ops' `rows` where the kernel handles its head size."""
        return rows if c.head_dim in ROPE_HEAD_DIMS else 0

    @property
    def attention_kernel(self) -> bool:
        """Whether every decode attention (slow and fast AR) runs the csrc kernel, which reads
        exactly positions 0..pos: the decode graphs then need one span bucket only."""
        return self.slow_kernel is not None and self.fast_kv.kernel is not None

    # ------------------------------------------------------------------ host -> device
    def apply(self, op: RowOp) -> None:
        """A row update the scheduler decided, on the current stream."""
        if op.kind == "join":
            assert op.col is not None and op.params is not None
            self.join(op.row, op.params, op.col, op.pos, op.max_frames, op.seed, op.blocks)
        elif op.kind == "extend":
            self.extend(op.row, op.pos, op.blocks)
        elif op.kind == "leave":
            self.leave(op.row)
        elif op.kind == "free":
            if self.prefixes is not None:
                self.prefixes.clear(op.row)
        else:
            raise ValueError(f"unknown row op {op.kind!r}")

    def join(self, row: int, params: SamplingParams, col: Tensor, pos: int, max_frames: int,
             seed: int, blocks: tuple[int, ...]) -> None:
        """Make `row` decode a turn from the next step on: its sampling parameters, its
        block table, and the column `col` [1+K] to feed at `pos`."""
        self.sampling.assign(row, params, seed)
        table = self.cache.table(list(blocks))
        vals = staging.to_device([pos, max_frames, seed, *col.tolist(), *table], self.device)
        K1 = self.cfg.frame_rows
        self.pos[row] = vals[0]
        self.frames_left[row] = vals[1]
        self.sampling.begin_turn_dev(row, vals[2])
        self.next_col[row] = vals[3: 3 + K1]
        self.tables[row] = vals[3 + K1:]
        self.active[row] = True
        if self.prefixes is not None:
            self.prefixes.set(row, blocks)

    def extend(self, row: int, index: int, blocks: tuple[int, ...]) -> None:
        """More blocks for a decoding row's table, from entry `index` on."""
        vals = staging.to_device(list(blocks), self.device)
        self.tables[row, index: index + len(blocks)] = vals
        if self.prefixes is not None:
            self.prefixes.extend(row, index, blocks)

    def leave(self, row: int) -> None:
        """Stop decoding `row` from the next step on (cancel)."""
        self.active[row] = False
        if self.prefixes is not None:
            self.prefixes.clear(row)

    # ------------------------------------------------------------------ blocks
    def own_blocks(self, row: int) -> tuple[int, ...]:
        """Row `row`'s own full context of blocks in the default pool (one per row): for
        callers that drive the runner without a scheduler (fixture checks, benches)."""
        per = -(-self.max_len // self.block_size)
        if (row + 1) * per > self.n_blocks:
            raise ValueError(f"the pool's {self.n_blocks} blocks hold no full context for "
                             f"row {row}")
        return tuple(range(row * per, (row + 1) * per))

    def table_tensor(self, blocks: list[int] | tuple[int, ...]) -> Tensor:
        """A block table row [MB] on the device (scratch past the blocks)."""
        return staging.to_device(self.cache.table(list(blocks)), self.device)

    def save(self, blocks: list[int]) -> tuple[Tensor, Tensor]:
        return self.cache.save(blocks)

    def restore(self, saved: tuple[Tensor, Tensor], blocks: list[int]) -> None:
        self.cache.restore(saved, blocks)

    def copy_block(self, src: int, dst: int) -> None:
        self.cache.copy_block(src, dst)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, blocks: list[int] | tuple[int, ...], cols: Tensor, start: int) -> Tensor:
        """cols: [1+K, T] prompt columns placed at positions start..start+T-1 of the sequence
        whose block table is `blocks`. Returns the final-normed hidden state of the last
        column [D]."""
        cols = cols.to(self.device, non_blocking=True)
        T = cols.shape[1]
        attend = PrefillAttend(self.cache, self.table_tensor(blocks), start, T)
        positions = torch.arange(start, start + T, device=self.device)[None]
        h = self.model.forward_slow(cols[None], positions, attend, self.ops)
        return h[0, -1]

    @torch.inference_mode()
    def prefill_batch(self, items: list[tuple[tuple[int, ...], Tensor, int]]) -> None:
        """Several prefills in one forward: items of (blocks, cols [1+K, n], start)."""
        if len(items) == 1:
            blocks, cols, start = items[0]
            self.prefill(blocks, cols, start)
            return
        T = max(c.shape[1] for _, c, _ in items)
        batch = torch.zeros(len(items), self.cfg.frame_rows, T, dtype=torch.long)
        for n, (_, c, _) in enumerate(items):
            batch[n, :, : c.shape[1]] = c
        tables = torch.empty(len(items), self.cache.table_width, dtype=torch.long,
                             device=self.device)
        staging.stage(tables, [self.cache.table(list(b)) for b, _, _ in items])
        attend = BatchedPrefillAttend(self.cache, tables, [st for _, _, st in items],
                                      [c.shape[1] for _, c, _ in items], T)
        self.model.forward_slow(batch.to(self.device, non_blocking=True), attend.positions,
                                attend, self.ops)

    def prefill_inputs(self, T: int, N: int = 1) -> dict[str, Tensor]:
        """Device buffers for `prefill_static` of N chunks of T columns (all rows on the
        scratch block at position 0 until filled in)."""
        d, c = self.device, self.cache
        return {"cols": torch.zeros(N, self.cfg.frame_rows, T, dtype=torch.long, device=d),
                "table": torch.full((N, c.table_width), c.scratch, dtype=torch.long, device=d),
                "start": torch.zeros(N, dtype=torch.long, device=d)}

    @torch.inference_mode()
    def prefill_static(self, inp: dict[str, Tensor], span: int) -> None:
        """`prefill_batch` with every input a device tensor (`prefill_inputs`): capturable
        as one CUDA graph per (N, T, span). The caller guarantees start + T <= span <= max_len
        for every row and distinct blocks for the real rows' positions."""
        T = inp["cols"].shape[2]
        positions = inp["start"][:, None] + torch.arange(T, device=self.device)  # [N, T]
        attend = TablePrefillAttend(self.cache, inp["table"], positions, span)
        self.model.forward_slow(inp["cols"], positions, attend, self.ops)

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def step(self, B: int, span: int) -> Tensor:
        """One frame for rows 0..B-1; `span` bounds max(pos)+1 of the active rows.
        Returns out [B, 1+K+2] int64: frame [t, c0..c9], was_active, stopped."""
        book = self.ops.book
        if self.prefixes is not None and not (self.device.type == "cuda"
                                              and torch.cuda.is_current_stream_capturing()):
            self.prefixes.refresh()  # a row op changed the plan (a capture reads the buffer)
        was, pos, wblock = book.step_begin(self.active[:B], self.pos[:B], self.tables[:B],
                                           self.cache.block_size, self.cache.scratch)
        columns = self.decode(self.next_col[:B], pos, self.tables[:B], wblock, span)
        # the frame's columns stacked, the rows' and the sampler's state advanced: one launch
        return book.step_end(columns, was, self.next_col[:B], self.pos[:B],
                             self.frames_left[:B], self.active[:B], self.sampling.step[:B],
                             self.cfg.ids.im_end)

    def decode(self, cols: Tensor, positions: Tensor, tables: Tensor, wblock: Tensor,
               span: int) -> list[Tensor]:
        """Rows 0..B-1 feed cols [B, 1+K] at positions [B] through their block tables
        [B, MB], writing into wblock [B] -> the frame's columns (`frame_from_hidden`)."""
        B = cols.shape[0]
        # with a shared-prefix plan the Triton kernel takes q rotated already: the model's
        # (compiled) q/k norm + RoPE then runs first, not the kernel's fold
        shared = self.prefixes is not None and 0 < self.ops.attention_triton_rows <= B
        attend = PagedDecodeAttend(self.cache, tables, wblock, positions, span, self.slow_kernel,
                                   not shared and B <= self._rope_rows(self.cfg.slow,
                                                                       self.ops.decode_rope),
                                   self.prefixes.tiles if shared else None)
        h = self.model.forward_slow(cols[:, :, None], positions[:, None], attend,
                                    self.ops)[:, 0]  # [B, D]
        return self.frame_from_hidden(h)

    def frame_from_hidden(self, h: Tensor) -> list[Tensor]:
        """Sample one frame for rows 0..B-1 from slow hidden states h [B, D] -> its 1+K
        columns [B] (token, code 0..K-1). The draws' step is advanced by the caller
        (`Bookkeeping.step_end`, with the rows' other state)."""
        m, ids, ops = self.model, self.cfg.ids, self.ops
        B = h.shape[0]
        rows = slice(0, B)
        idx = self.sampling.sample_main(rows, m.semantic_logits(h, ops), self.n_semantic)
        # x [B, 2, D]: the fast AR's positions 0 (h) and 1 (code 0's row of its embeddings),
        # one pass (its weights read once for both); position 1's logits give code 1
        token, code, x = ops.book.frame_tokens(idx, self.n_semantic, ids.semantic_start,
                                               ids.im_end, m.fast_embeddings.weight, h)
        fkv = self.fast_kv
        codes, K = [code], self.cfg.num_codebooks
        logits = m.forward_fast(x, 0, fkv.at(0, B), ops)[:, -1]
        for j in range(1, K - 1):
            # code j, and its row of the fast embeddings (position j+1's input): one launch
            code, x = self.sampling.sample_fast_embed(rows, logits, j, m.fast_embeddings.weight)
            codes.append(code)
            logits = m.forward_fast(x[:, None], j + 1, fkv.at(j + 1, B), ops)[:, 0]
        codes.append(self.sampling.sample_fast(rows, logits, K - 1))
        return [token, *codes]

    # ------------------------------------------------------------------ decode graphs
    def warm_steps(self, stream: torch.cuda.Stream, batches: list[int],
                   spans: list[int]) -> float:
        """Run the step once per batch and span bucket, eagerly, on `stream` with every row
        inactive (writes go to the scratch block; no row's state changes): fused (compiled)
        ops specialise on the batch size, and nothing may compile or autotune inside a
        capture. Returns the seconds."""
        t0 = time.perf_counter()
        with self._rows_inactive(stream), torch.cuda.stream(stream):
            for span in spans:
                self.step(batches[0], span)
            for b in batches:
                self.step(b, spans[0])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def capture_steps(self, stream: torch.cuda.Stream, keys: list[tuple[int, int]]) -> float:
        """One CUDA graph of the whole `step` per (batch, span) key, after `warm_steps`,
        captured on `stream` (the stream that replays them) with every row inactive, and put
        in use. Returns the seconds."""
        t0 = time.perf_counter()
        with self._rows_inactive(stream):
            if keys:
                # once eagerly on this thread first: a thread's first cuBLAS call creates its
                # handle, which must not happen inside a capture (it invalidates it), and the
                # decode thread captures the deferred graphs without having stepped before
                with torch.cuda.stream(stream):
                    self.step(*keys[0])
            # one memory pool for every step graph, those captured later included: they
            # replay one at a time on one stream, each output read before the next replay
            graphs = capture_graphs(stream, keys, lambda key: None,
                                    lambda key, _: self.step(*key), pool=self._step_pool)
        if graphs and self._step_pool is None:
            self._step_pool = next(iter(graphs.values()))[0].pool()
        self.step_graphs.update({key: (g, out) for key, (g, _, out) in graphs.items()})
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def _rows_inactive(self, stream: torch.cuda.Stream) -> Iterator[None]:
        # on `stream`, after the work already queued there: every row inactive, then every
        # row's state as it was. A step advances the sampler's step and RAS window of every
        # row in the batch, active or not, so those are kept too: rows may be mid-turn here
        # (a deferred capture while every speaking turn is far enough ahead of playback)
        s = self.sampling
        with torch.cuda.stream(stream):
            saved = [(t, t.clone()) for t in (self.active, self.pos, s.step, s.window)]
            self.active.zero_()
        try:
            yield
        finally:
            with torch.cuda.stream(stream):
                for t, copy in saved:
                    t.copy_(copy)

    def launch(self, B: int, span: int) -> Tensor:
        """Queue one step of rows 0..B-1 over keys [0, span): a graph replay where one was
        captured (B and span must then be buckets), else eager. Returns its output tensor
        (a graph's static output: read it before the next launch of the same key)."""
        graph = self.step_graphs.get((B, span))
        if graph is None:
            return self.step(B, span)  # stages a changed shared-prefix plan itself
        if self.prefixes is not None:  # a row op changed the plan: stage it before the replay
            self.prefixes.refresh()
        g, out = graph
        g.replay()
        return out
