"""Stateful streaming decoder, batched over streams.

Each open stream owns a slot in preallocated state buffers (one ``[max_streams, ...]`` tensor
per stateful layer: conv tails, transposed-conv input history, the window attention's K/V
rings, layers.ring_size). A :meth:`StreamingDecoder.decode` call

1. right-pads the given chunks to the longest one (passes of at most ``MAX_PASS_FRAMES``
   frames; a longer chunk continues in the next pass) and stacks them into one batch,
2. gathers the state rows of those streams (``index_select``),
3. runs the codec's decode path once for the whole batch (``Codec.stream_decode``), whose
   window attention writes and reads the streams' K/V rings in place (no gather),
4. scatters the new state back (``index_copy_``) and cuts each stream's samples.

Every value is checked before the first pass, so a bad chunk changes no stream; a call of
several passes that fails on the device later keeps what its earlier passes decoded (each
stream's position moves with its state, pass by pass).

Because every layer is causal and every saved tail is taken at the stream's own valid end,
the concatenated output of any chunking equals the offline ``Codec.decode`` of the whole
sequence up to float rounding (kernels sum in different orders for different lengths);
:data:`STREAM_ATOL` is the tolerance the tests and reference checks use.

With ``buckets=True`` every call is padded to a (streams, frames) bucket: missing rows are
the scratch state row, missing frames are padding the lengths mask out, a chunk longer
than the largest frame bucket is decoded in several passes, and more streams than the largest
stream bucket (``graph_streams``) in several groups. On a CUDA device each bucket's
pass (state gather, the whole decode, state scatter) is then captured once as a CUDA graph
(``capture()``) and a tick is one graph replay instead of ~2,000 kernel launches from Python.
Buckets need the transformer's RoPE table sized up front, so a stream may decode at most
``max_frames`` frames (the engine passes its turn limit).

Not thread-safe: one caller (the engine's codec thread) drives a decoder; only ``capture``
may run on another thread next to it (it touches the scratch state row alone).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from .. import capture as graphs
from .. import staging
from .layers import MAX_PASS_FRAMES, CodecOps, StreamContext, WindowLimitedTransformer
from .model import Codec

__all__ = ["STREAM_ATOL", "StreamingDecoder"]

# Max abs difference allowed between streamed and offline float32 audio (against our offline
# decode or the reference's). Measured on this project's 2-core AVX-512 CPU: <= 8.9e-6 over 30
# random chunkings of the fixture codec, <= 8.1e-6 vs the reference audio. The decoder amplifies
# rounding: a 1-ulp random perturbation of the latent alone moves the audio by 4e-6..7e-6, so
# 1e-5 would be flaky; 2e-5 is still -94 dB below full scale.
STREAM_ATOL = 2e-5


class StreamingDecoder:
    """Incremental decode of many code streams in shared, batched calls.

    >>> dec = StreamingDecoder(codec, max_streams=64)
    >>> sid = dec.open()
    >>> out = dec.decode({sid: codes_chunk})   # codes_chunk: int [10, n] -> {sid: [n*2048]}

    ``ops``: the pointwise ops of the streaming layers (engine/ops.py builds the csrc
    kernels' set; the torch formulas by default).
    """

    FRAME_BUCKETS = (1, 2, 4, 8, 16)  # frames per pass in bucketed mode
    assert FRAME_BUCKETS[-1] <= MAX_PASS_FRAMES  # the attention rings are sized for it
    # each layer's state starts at a multiple of this many elements of a stream's flat row
    # (and the row's width is one): aligned views for the attention and conv kernels
    STATE_ALIGN = 64
    STREAM_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # streams per pass
    # capture() lets cuDNN time its algorithms (cudnn.benchmark) for buckets of this many
    # stream-frames (streams x frames) and more. Its heuristic NHWC plans are far off for some
    # sizes, not monotonically: on the H200 graphed ticks of 16 and 24 stream-frames took
    # 40-76 ms (16 x 1 75.6 ms, 1 x 16 39.5) where every bucket below took 2.5-3.9 ms, and the
    # 384-channel dilation-9 conv at 64 x 8 took 552 ms per call vs 0.82 autotuned
    # (docs/perf/gpu_s14_*): one such pass stalls every stream. With this rule the buckets of
    # 1, 8 and 16 streams re-measured tick in proportion to their size (1 x 16 3.8 ms, 8 x 2
    # 4.4, 16 x 1 4.7), as every autotuned bucket of 32 stream-frames and more already did.
    # At most AUTOTUNE_LIMIT algorithms are timed per shape (cudnn.benchmark_limit): 3 find
    # the same plans as cuDNN's default 10 (64 x 8 graphed tick 18.98 vs 19.1 ms) in far less
    # time.
    AUTOTUNE_MIN_WORK = 16
    AUTOTUNE_LIMIT = 3
    # a graphed tick costs about as much as one of this many streams more (H200, channels-last:
    # 1 x 2 frames 2.46 ms, 64 x 2 9.7 ms): what `_group_streams` weighs replays by
    _FLOOR_STREAMS = 20
    _TUNE_LOCK = threading.Lock()  # the cuDNN autotuner flag is process-wide

    def __init__(self, codec: Codec, max_streams: int = 64, *, buckets: bool = False,
                 max_frames: int = 4096, graph_streams: int | None = None,
                 ops: CodecOps | None = None, call_frames: int = 0) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be an engine.codec.Codec, got {type(codec).__name__}")
        if isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1:
            raise ValueError(f"max_streams must be a positive int, got {max_streams!r}")
        if not (isinstance(max_frames, int) and max_frames >= 1):
            raise ValueError(f"max_frames must be a positive int, got {max_frames!r}")
        graph_streams = max_streams if graph_streams is None else graph_streams
        if isinstance(graph_streams, bool) or not isinstance(graph_streams, int) \
                or not 1 <= graph_streams <= max_streams:
            raise ValueError(f"graph_streams must be an int in [1, max_streams={max_streams}], "
                             f"got {graph_streams!r}")
        self.codec = codec.eval()
        self.ops = ops if ops is not None else CodecOps()
        self.max_streams = max_streams
        self.device = codec.device
        self.dtype = codec.dtype
        self.frame_length = codec.frame_length
        self.max_frames = max_frames
        # unbucketed passes: at most this many (streams x padded frames) per pass (0: all at
        # once); a pass's working memory grows with it
        self.call_frames = call_frames
        # state buffers: key -> [max_streams + 1, *per-stream shape], zeros = "nothing before";
        # the last row is scratch: bucket padding reads and writes it, no stream owns it.
        # They are views of one [max_streams + 1, width] buffer, so a pass gathers and
        # scatters every layer's state in one indexed copy each (a copy per layer and
        # direction was 72 small kernels of a tick). The attention's K/V rings (95 % of the
        # bytes, of which a pass changes at most 16 frames) live in a second such buffer
        # that the layers write and read in place (`Stateful.ring_shapes`): no pass copies
        # them back.
        modules = codec.streaming_modules()
        self._shapes = {f"{m.state_key}.{name}": shape for m in modules
                        for name, shape in m.state_shapes().items()}
        self._ring_shapes = {f"{m.state_key}.{name}": shape for m in modules
                             for name, shape in m.ring_shapes().items()}
        # each key's offset in a stream's row, laid out once (every pass gathers and
        # scatters by them)
        self._at, width = self._offsets(self._shapes)
        self._ring_at, ring_width = self._offsets(self._ring_shapes)
        self._flat = torch.zeros(max_streams + 1, width, device=self.device, dtype=self.dtype)
        self._ring_flat = torch.zeros(max_streams + 1, ring_width, device=self.device,
                                      dtype=self.dtype)
        self._state = self._views(self._flat)
        self._rings = self._views(self._ring_flat, self._ring_shapes, self._ring_at)
        # the alignment gaps of a row of new state, in key order (zeros: one cat per pass)
        self._gaps = [-math.prod(shape) % self.STATE_ALIGN for shape in self._shapes.values()]
        self._gap = torch.zeros(max_streams + 1, self.STATE_ALIGN, device=self.device,
                                dtype=self.dtype)
        self.buckets = buckets
        # stream buckets stop at graph_streams: the engine opens twice its slots (turns still
        # draining) but rarely decodes more than its slots at once, and the biggest buckets
        # cost the most to capture (64 -> 128 -> 256 streams: most of the start-up)
        # Between the powers of two, 12, 24, 48 and 96 too: a tick of 40 streams pads to 48,
        # not 64 (the bigger buckets are captured in the background: engine/warmup.py)
        self.stream_buckets = graphs.buckets(self.STREAM_LADDER, graph_streams)
        # (streams, frames) -> (graph or None, static inputs, static audio output)
        self._passes: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, dict[str, Tensor],
                                                  Tensor | None]] = {}
        if buckets:  # RoPE rows for every position a stream may reach, allocated once
            for m in codec.modules():
                if isinstance(m, WindowLimitedTransformer):
                    m.rope_rows(max_frames + max(self.FRAME_BUCKETS), self.device)
        self._slot_of: dict[int, int] = {}  # stream id -> slot
        self._free: list[int] = list(range(max_streams - 1, -1, -1))  # pop() gives lowest slot
        self._position = [0] * max_streams  # frames decoded so far, per slot (host side)
        self._next_id = 0

    # -- stream management -----------------------------------------------------------------------
    @property
    def n_open(self) -> int:
        return len(self._slot_of)

    @property
    def graphs(self) -> int:
        # a copy first: the background capture (engine/warmup.py) adds passes meanwhile
        return sum(g is not None for g, _, _ in list(self._passes.values()))

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self._state.values(), *self._rings.values()))

    def open(self) -> int:
        """Open a new stream; returns its id (ids are never reused)."""
        if not self._free:
            raise RuntimeError(
                f"StreamingDecoder is full: all {self.max_streams} streams are open "
                "(close one, or build the decoder with a larger max_streams)"
            )
        slot = self._free.pop()
        sid = self._next_id
        self._next_id += 1
        self._slot_of[sid] = slot
        self._clear(slot)
        return sid

    def close(self, sid: int) -> None:
        slot = self._slot(sid)
        del self._slot_of[sid]
        self._free.append(slot)
        self._free.sort(reverse=True)

    def reset(self, sid: int) -> None:
        """Forget the stream's history: the next chunk decodes as if it were the first."""
        self._clear(self._slot(sid))

    def position(self, sid: int) -> int:
        """Code frames this stream has decoded so far."""
        return self._position[self._slot(sid)]

    def _slot(self, sid: int) -> int:
        try:
            return self._slot_of[sid]
        except (KeyError, TypeError):
            raise KeyError(f"unknown or closed stream id {sid!r}") from None

    def _clear(self, slot: int) -> None:
        with torch.no_grad():
            self._flat[slot].zero_()
            self._ring_flat[slot].zero_()
        self._position[slot] = 0

    def _offsets(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
        """Where each key starts in a stream's row (STATE_ALIGN-aligned), and the row width."""
        at, width = {}, 0
        for k, shape in shapes.items():
            at[k] = width
            width += -(-math.prod(shape) // self.STATE_ALIGN) * self.STATE_ALIGN
        return at, width

    def _views(self, flat: Tensor, shapes: Mapping[str, tuple[int, ...]] | None = None,
               at: Mapping[str, int] | None = None) -> dict[str, Tensor]:
        """Each key's rows as a view of `flat` [B, width] ([B, *shape] per key; the
        gathered state's keys and offsets by default)."""
        shapes, at = (self._shapes, self._at) if shapes is None else (shapes, at)
        assert at is not None
        return {k: flat[:, at[k]: at[k] + math.prod(shape)].view(flat.shape[0], *shape)
                for k, shape in shapes.items()}

    def _gather_state(self, slots: Tensor) -> dict[str, Tensor]:
        """The streams' state ([B, *shape] per key), in one indexed copy."""
        return self._views(self._flat.index_select(0, slots))

    # -- decoding --------------------------------------------------------------------------------
    def decode(self, chunks: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """Decode the next code frames of several streams in one batched pass.

        ``chunks``: {stream id: integer codes [10, n]} (n may differ per stream, including 0;
        values are clamped like ``Codec.decode``). Returns {stream id: float32 samples
        [n * 2048]} on the codec's device.
        """
        if not isinstance(chunks, Mapping):
            raise TypeError(
                f"chunks must be a mapping {{stream id: codes [10, n]}}, got {type(chunks).__name__}"
            )
        items: list[tuple[int, int, Tensor]] = []
        for sid, codes in chunks.items():
            slot = self._slot(sid)
            self.codec.check_codes(codes, f"codes for stream {sid}", ndim=2, values=False)
            items.append((sid, slot, codes))
        out: dict[int, Tensor] = {}
        active = [(sid, slot, c) for sid, slot, c in items if c.shape[-1] > 0]
        for sid, _, c in items:
            if c.shape[-1] == 0:
                out[sid] = torch.zeros(0, device=self.device, dtype=torch.float32)
        if not active:
            return out

        lengths = [c.shape[-1] for _, _, c in active]
        slots = [slot for _, slot, _ in active]
        positions = [self._position[s] for s in slots]
        if self.buckets:
            # every check before the first pass: a failed call changes no stream's state
            for (sid, _, _), p, n in zip(active, positions, lengths):
                if p + n > self.max_frames:
                    raise ValueError(f"stream {sid} would reach frame {p + n}, over this decoder's "
                                     f"max_frames={self.max_frames} (build it with a larger limit)")
            codes_host = [c.detach().to("cpu", torch.long) for _, _, c in active]
            self._check_values(torch.cat(codes_host, dim=-1), active)  # on the host: no sync
            g = self._group_streams(len(active))
            for i in range(0, len(active), g):
                out.update(self._decode_bucketed(active[i: i + g], codes_host[i: i + g],
                                                 lengths[i: i + g], slots[i: i + g],
                                                 positions[i: i + g]))
            return out
        # every value check before the first pass: a failed call changes no stream's state
        self._check_values(torch.cat([c.reshape(-1).to(self.device) for _, _, c in active]),
                           active)
        for group in self._groups(active):
            # passes of at most MAX_PASS_FRAMES frames (the attention rings' bound): a
            # stream's longer chunk continues in the next pass, from its state
            pieces: dict[int, list[Tensor]] = {sid: [] for sid, _, _ in group}
            for at in range(0, max(c.shape[-1] for _, _, c in group), MAX_PASS_FRAMES):
                part = [(sid, slot, c[:, at: at + MAX_PASS_FRAMES])
                        for sid, slot, c in group if c.shape[-1] > at]
                got = self._decode_group(part, [self._position[slot] for _, slot, _ in part])
                for sid, audio in got.items():
                    pieces[sid].append(audio)
            out.update({sid: p[0] if len(p) == 1 else torch.cat(p) for sid, p in pieces.items()})
        return out

    def _groups(self, active: list[tuple[int, int, Tensor]]) -> list[list[tuple[int, int, Tensor]]]:
        """`active` in groups of at most call_frames streams x padded frames per pass (a
        pass carries at most MAX_PASS_FRAMES frames of each; a stream longer than the bound
        gets a group of its own)."""
        if self.call_frames <= 0:
            return [active]
        groups: list[list[tuple[int, int, Tensor]]] = [[]]
        widest = 0
        for item in active:
            n = min(item[2].shape[-1], MAX_PASS_FRAMES)
            if groups[-1] and (len(groups[-1]) + 1) * max(widest, n) > self.call_frames:
                groups.append([])
                widest = 0
            groups[-1].append(item)
            widest = max(widest, n)
        return groups

    def _decode_group(self, active: list[tuple[int, int, Tensor]],
                      positions: list[int]) -> dict[int, Tensor]:
        out: dict[int, Tensor] = {}
        lengths = [c.shape[-1] for _, _, c in active]
        slots = [slot for _, slot, _ in active]
        n_max = max(lengths)
        n_cb = self.codec.n_codebooks_total
        # batch: [B, 10, n_max] right-padded with code 0 (never reaches a valid output)
        batch = torch.zeros((len(active), n_cb, n_max), dtype=torch.long, device=self.device)
        for i, (_, _, c) in enumerate(active):
            batch[i, :, : c.shape[-1]] = c.to(self.device)
        self._check_values(batch, active)
        batch = self.codec.quantizer.clamp_codes(batch)
        slots_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        ctx = StreamContext(
            lengths=torch.tensor(lengths, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            n_max=n_max,
            max_position=max(positions),
            state=self._gather_state(slots_t),
            uniform=all(n == n_max for n in lengths),
            ops=self.ops,
            rings=self._rings,
            slots=slots_t,
        )
        with torch.no_grad():
            audio = self.codec.stream_decode(batch, ctx)  # [B, 1, n_max * 2048]
            self._store_state(ctx, slots_t)
        for i, (sid, slot, _) in enumerate(active):
            self._position[slot] += lengths[i]
            out[sid] = audio[i, 0, : lengths[i] * self.frame_length].float()
        return out

    def _check_values(self, batch: Tensor, active: list[tuple[int, int, Tensor]]) -> None:
        # one value check for the whole call (a single device sync), naming the stream on failure
        if bool((batch < 0).any()):
            bad = [sid for sid, _, c in active if bool((c < 0).any())]
            raise ValueError(f"codes for stream {bad[0]} contain negative values")

    def _store_state(self, ctx: StreamContext, slots_t: Tensor) -> None:
        if ctx.new_state.keys() != self._state.keys():
            missing = sorted(self._state.keys() - ctx.new_state.keys())
            raise RuntimeError(f"streaming pass left state not updated: {missing[:4]}")
        if self._state:
            B, pieces = len(slots_t), []
            for k, gap in zip(self._shapes, self._gaps):
                pieces.append(ctx.new_state[k].reshape(B, -1))
                if gap:  # alignment gaps (never read): zeros, so the rows are one cat
                    pieces.append(self._gap[:B, :gap])
            self._flat.index_copy_(0, slots_t, torch.cat(pieces, dim=1))

    # -- bucketed passes (CUDA graphs on a GPU) ------------------------------------------------------
    def _static_pass(self, inp: dict[str, Tensor]) -> Tensor:
        """Gather state, decode, scatter state for fixed-shape inputs; graph-capturable (no
        host sync, no shape that depends on values)."""
        codes = self.codec.quantizer.clamp_codes(inp["codes"])
        ctx = StreamContext(lengths=inp["lengths"], positions=inp["positions"],
                            n_max=codes.shape[-1], max_position=0,
                            state=self._gather_state(inp["slots"]), uniform=False,
                            ops=self.ops, rings=self._rings, slots=inp["slots"])
        audio = self.codec.stream_decode(codes, ctx)  # [Bb, 1, nb * 2048]
        self._store_state(ctx, inp["slots"])
        return audio

    def _inputs(self, Bb: int, nb: int) -> dict[str, Tensor]:
        d = self.device
        return {"codes": torch.zeros(Bb, self.codec.n_codebooks_total, nb, dtype=torch.long, device=d),
                "slots": torch.full((Bb,), self.max_streams, dtype=torch.long, device=d),
                "lengths": torch.ones(Bb, dtype=torch.long, device=d),
                "positions": torch.zeros(Bb, dtype=torch.long, device=d)}

    def _complete(self, streams: int) -> bool:
        """Every frame bucket of this stream bucket has its graph."""
        return all(self._passes.get((streams, n), (None,))[0] is not None
                   for n in self.FRAME_BUCKETS)

    def _group_streams(self, n: int) -> int:
        """Streams per bucketed pass for a tick of `n` streams: the largest stream bucket, or
        while graphs are still being captured in the background (engine/warmup.py) and the
        bucket `n` needs is not in yet, the fully captured bucket whose replays cost least
        for `n` streams (a replay's cost: a launch-bound floor plus a share per stream) — a
        few replays, or one padded one, cost less than an eager pass of ~2,000 launches."""
        top = self.stream_buckets[-1]  # also without graphs: then nothing is complete
        n = min(n, top)
        want = graphs.bucket(self.stream_buckets, n)
        assert want is not None
        done = [b for b in self.stream_buckets if self._complete(b)]
        if self._complete(want) or not done:
            return top
        return min(done, key=lambda b: -(-n // b) * (1 + b / self._FLOOR_STREAMS))

    def _pass_streams(self, n: int) -> int:
        """The stream bucket a pass of `n` streams runs in: the smallest that holds them, or
        the smallest fully captured one above it while that one is not in yet."""
        want = graphs.bucket(self.stream_buckets, n)
        assert want is not None  # decode() passes at most the largest bucket's streams
        if self._complete(want):
            return want
        return next((b for b in self.stream_buckets if b > want and self._complete(b)), want)

    def bucket_keys(self) -> list[tuple[int, int]]:
        """Every (streams, frames) bucket a graph is captured for."""
        return [(b, n) for b in self.stream_buckets for n in self.FRAME_BUCKETS]

    def warm_keys(self) -> list[tuple[int, int]]:
        """One bucket per class of shapes a compiled op specialises on (torch.compile's
        dynamic shapes still treat a size of 1 as a constant): one and several streams x one
        and several frames, as far as the buckets have them."""
        streams = sorted({self.stream_buckets[0], next(
            (b for b in self.stream_buckets if b > 1), self.stream_buckets[0])})
        frames = sorted({self.FRAME_BUCKETS[0], next(f for f in self.FRAME_BUCKETS if f > 1)})
        return [(s, f) for s in streams for f in frames]

    @torch.no_grad()
    def warm(self, keys: list[tuple[int, int]] | None = None) -> float:
        """One eager bucketed pass per key (default `warm_keys`) on the scratch state row
        (no stream's state changes), so that the compiled ops (engine/ops.py) compile every
        specialisation now: before the engine is ready, not in a background capture of a
        bigger bucket while it serves (on the CPU's inductor a pass of two streams compiled 15
        graphs in ~8 s after the one-stream buckets' 15). Returns the seconds."""
        import time

        t0 = time.perf_counter()
        for key in self.warm_keys() if keys is None else keys:
            self._static_pass(self._inputs(*key))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def _cudnn_plans(self, streams: int, frames: int) -> Iterator[None]:
        """cuDNN caches a plan per shape and thread, chosen on the shape's first run there (a
        shape run once with its autotuner off keeps the heuristic plan): a capture's warm-up
        of AUTOTUNE_MIN_WORK stream-frames and more runs with the autotuner on, and the graph
        keeps the plan. The flag is process-wide: set under a lock shared by every decoder
        (other threads' convolutions meanwhile, e.g. the reference encoder's, autotune too)."""
        cudnn = torch.backends.cudnn
        with self._TUNE_LOCK:
            tuned, limit = cudnn.benchmark, cudnn.benchmark_limit
            if not tuned and streams * frames >= self.AUTOTUNE_MIN_WORK:
                cudnn.benchmark, cudnn.benchmark_limit = True, self.AUTOTUNE_LIMIT
            try:
                yield
            finally:
                cudnn.benchmark, cudnn.benchmark_limit = tuned, limit

    @torch.no_grad()
    def capture(self, side: torch.cuda.Stream | None = None,
                keys: list[tuple[int, int]] | None = None, *,
                stop: Callable[[], bool] | None = None,
                captured: Callable[[tuple[int, int]], None] | None = None) -> float:
        """Capture one CUDA graph per (streams, frames) bucket in `keys` (default: all);
        returns the seconds it took. Only the scratch state row is touched, so this may run
        while another thread decodes. Pass the stream that will replay the graphs, or one
        nothing else uses: they are warmed and captured on it (cuBLAS's per-stream
        workspace is baked into each graph; graphs of two families captured on one stream
        and replayed concurrently would share it). Each graph is used once it is in."""
        if not self.buckets or self.device.type != "cuda":
            raise RuntimeError("capture() needs buckets=True and a CUDA codec")
        import time

        t0 = time.perf_counter()
        keys = self.bucket_keys() if keys is None else list(keys)
        side = side if side is not None else torch.cuda.Stream(self.device)

        def warmed(key: tuple[int, int]) -> dict[str, Tensor]:
            # each shape runs once eagerly right before its capture (cuDNN's plan, the
            # allocator), so that every graph is in use as soon as it can be, not after
            # every bucket's warm-up
            inp = self._inputs(*key)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), self._cudnn_plans(*key):
                self._static_pass(inp)
            return inp

        def install(key: tuple[int, int], entry: tuple[torch.cuda.CUDAGraph, Any, Any]) -> None:
            self._passes[key] = entry
            if captured is not None:
                captured(key)

        graphs.capture_graphs(side, sorted(keys, reverse=True),  # largest first
                              warmed, lambda key, inp: self._static_pass(inp), stop=stop,
                              captured=install)
        return time.perf_counter() - t0

    def _decode_bucketed(self, active: list[tuple[int, int, Tensor]], codes_host: list[Tensor],
                         lengths: list[int], slots: list[int],
                         positions: list[int]) -> dict[int, Tensor]:
        B = len(active)
        Bb = self._pass_streams(B)
        pieces: list[list[Tensor]] = [[] for _ in range(B)]
        done = [0] * B
        while (left := max(n - d for n, d in zip(lengths, done))) > 0:
            nb = graphs.bucket(self.FRAME_BUCKETS, min(left, self.FRAME_BUCKETS[-1]))
            assert nb is not None
            graph, inp, audio = self._passes.get((Bb, nb), (None, None, None))
            if inp is None:
                inp = self._inputs(Bb, nb)
            take = [min(n - d, nb) for n, d in zip(lengths, done)]
            # this pass's inputs, built on the host and staged in two copies
            codes = staging.host((Bb, self.codec.n_codebooks_total, nb), torch.long, self.device)
            # padding rows (and streams with nothing left): the scratch state row, 1 frame
            meta = [[self.max_streams] * Bb, [1] * Bb, [0] * Bb]
            for i in range(B):
                if take[i] > 0:
                    codes[i, :, : take[i]] = codes_host[i][:, done[i]: done[i] + take[i]]
                    meta[0][i], meta[1][i], meta[2][i] = slots[i], take[i], positions[i] + done[i]
            staging.stage(inp["codes"], codes)
            for row, key in enumerate(("slots", "lengths", "positions")):
                staging.stage(inp[key], meta[row])
            if graph is not None:
                graph.replay()
            else:  # not captured (yet: engine/warmup.py); cuDNN's autotuner stays off here:
                # its plan cache is per thread, and timing plans would stall the ticks
                audio = self._static_pass(inp)
            # copy out now: the next pass overwrites the static output
            flat = audio[:B, 0].to(torch.float32, copy=True)  # [B, nb * 2048]: no padding rows
            for i in range(B):
                if take[i] > 0:
                    pieces[i].append(flat[i, : take[i] * self.frame_length])
                    done[i] += take[i]
                    # with the pass's state: a later pass that fails leaves them in step
                    self._position[slots[i]] += take[i]
        out: dict[int, Tensor] = {}
        for i, (sid, _, _) in enumerate(active):
            out[sid] = pieces[i][0] if len(pieces[i]) == 1 else torch.cat(pieces[i])
        return out
