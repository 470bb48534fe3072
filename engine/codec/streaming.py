"""Stateful streaming decoder, batched over streams.

Each open stream owns a slot in preallocated state buffers (one ``[max_streams, ...]`` tensor
per stateful layer: conv tails, transposed-conv input history, attention K/V windows of the last
``window-1`` frames). A :meth:`StreamingDecoder.decode` call

1. right-pads the given chunks to the longest one and stacks them into one batch,
2. gathers the state rows of those streams (``index_select``),
3. runs the codec's decode path once for the whole batch (``Codec.stream_decode``),
4. scatters the new state back (``index_copy_``) and cuts each stream's samples.

Because every layer is causal and every saved tail is taken at the stream's own valid end,
the concatenated output of any chunking equals the offline ``Codec.decode`` of the whole
sequence up to float rounding (kernels sum in different orders for different lengths);
:data:`STREAM_ATOL` is the tolerance the tests and reference checks use.

Not thread-safe: one caller (the engine's codec thread) drives a decoder.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .layers import StreamContext
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
    """

    def __init__(self, codec: Codec, max_streams: int = 64) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be an engine.codec.Codec, got {type(codec).__name__}")
        if isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1:
            raise ValueError(f"max_streams must be a positive int, got {max_streams!r}")
        self.codec = codec.eval()
        self.max_streams = max_streams
        self.device = codec.device
        self.dtype = codec.dtype
        self.frame_length = codec.frame_length
        # state buffers: key -> [max_streams, *per-stream shape], zeros = "nothing before"
        self._state: dict[str, Tensor] = {}
        for m in codec.streaming_modules():
            for name, shape in m.state_shapes().items():
                self._state[f"{m.state_key}.{name}"] = torch.zeros(
                    (max_streams, *shape), device=self.device, dtype=self.dtype
                )
        self._slot_of: dict[int, int] = {}  # stream id -> slot
        self._free: list[int] = list(range(max_streams - 1, -1, -1))  # pop() gives lowest slot
        self._position = [0] * max_streams  # frames decoded so far, per slot (host side)
        self._next_id = 0

    # -- stream management -----------------------------------------------------------------------
    @property
    def n_open(self) -> int:
        return len(self._slot_of)

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state.values())

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
            for buf in self._state.values():
                buf[slot].zero_()
        self._position[slot] = 0

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
        n_max = max(lengths)
        n_cb = self.codec.n_codebooks_total
        # batch: [B, 10, n_max] right-padded with code 0 (never reaches a valid output)
        batch = torch.zeros((len(active), n_cb, n_max), dtype=torch.long, device=self.device)
        for i, (_, _, c) in enumerate(active):
            batch[i, :, : c.shape[-1]] = c.to(self.device)
        # one value check for the whole call (a single device sync), naming the stream on failure
        if bool((batch < 0).any()):
            bad = [sid for sid, _, c in active if bool((c < 0).any())]
            raise ValueError(f"codes for stream {bad[0]} contain negative values")
        batch = self.codec.quantizer.clamp_codes(batch)

        slots = [slot for _, slot, _ in active]
        slots_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        positions = [self._position[s] for s in slots]
        ctx = StreamContext(
            lengths=torch.tensor(lengths, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            n_max=n_max,
            max_position=max(positions),
            state={k: buf.index_select(0, slots_t) for k, buf in self._state.items()},
            uniform=all(n == n_max for n in lengths),
        )
        with torch.no_grad():
            audio = self.codec.stream_decode(batch, ctx)  # [B, 1, n_max * 2048]
            if ctx.new_state.keys() != self._state.keys():
                missing = sorted(self._state.keys() - ctx.new_state.keys())
                raise RuntimeError(f"streaming pass left state not updated: {missing[:4]}")
            for k, buf in self._state.items():
                buf.index_copy_(0, slots_t, ctx.new_state[k])
        for i, (sid, slot, _) in enumerate(active):
            self._position[slot] += lengths[i]
            out[sid] = audio[i, 0, : lengths[i] * self.frame_length].float()
        return out
