"""Building blocks of the modded-DAC codec, offline and streaming.

Every layer has an offline ``forward`` that reproduces the reference computation op for op (the
same torch ops in the same order, so float32 results agree with the fixtures to the last bit
where the kernels allow), and, where the layer carries history, a ``stream`` method that
continues a batch of streams from saved state:

- causal convs keep the last ``(kernel-1)*dilation`` input samples ("tail");
- causal transposed convs keep the last ``ceil((kernel-stride)/stride)`` input samples (the
  inputs whose kernel overlaps outputs not yet emitted);
- windowed attention keeps the post-RoPE keys/values in a ring of ``ring_size(window)``
  slots (frame p in slot p mod size): a pass writes its new frames' k/v into their slots and
  attends over the whole ring, masked by the position each slot holds — no concatenation of
  the window with the new frames and no cut of the next window, as a tail would need.

Streaming batches are right-padded to the longest chunk in the call (at most
``MAX_PASS_FRAMES`` frames). Everything is causal, so padding never leaks into valid outputs;
the only place it matters is where a layer saves its tail, which
:meth:`StreamContext.take_last` takes at each stream's own valid end (and the ring, whose
size keeps padded frames' slots out of every window still to be read).

Shapes: conv-side tensors are ``[B, C, T]``; transformer internals ``[B, T, D]``. In memory
the conv side is channels-first, or, with ``CodecOps.channels_last`` (the CUDA engine's
codec), channels-last (stored ``[B, T, C]``): the convs then run as NHWC 2-D convs
(``conv_cl``) and every pointwise op keeps its input's layout, so no layer transposes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional import add_scaled, apply_rope, norm_rope_qk, rms_norm, rope_table, silu_mul
from ..fusion import derived, packed
from ..kernels.activation import (
    bias_residual_torch,
    cat_time,
    empty_like_layout,
    snake_cat_torch,
    snake_formula,
    snake_torch,
)
from ..kernels.codec_conv import (
    Plan,
    causal_conv,
    conv_taps,
    residual_unit,
    transposed_weight,
    unit_supported,
    upsample,
)
from ..kernels.codec_conv import supported as causal_conv_supported
from .config import WindowTransformerConfig

__all__ = [
    "MAX_PASS_FRAMES",
    "Attention",
    "CausalConv1d",
    "CausalConvTranspose1d",
    "CodecOps",
    "ConvNeXtBlock",
    "FeedForward",
    "LayerScale",
    "RMSNorm",
    "ResidualUnit",
    "Snake1d",
    "Stateful",
    "StreamContext",
    "TransformerBlock",
    "WindowLimitedTransformer",
    "conv_cl",
    "ring_size",
    "ring_window",
    "snake",
    "stream_modules",
    "stream_sequential",
    "take_last",
]


# ---------------------------------------------------------------------------------------------
# Streaming plumbing
# ---------------------------------------------------------------------------------------------
# The most (padded) frames one streaming pass carries: StreamingDecoder splits longer chunks
# into passes of at most this many. The attention's K/V ring is sized by it (`ring_size`).
MAX_PASS_FRAMES = 16


def ring_size(window: int) -> int:
    """Slots of a window attention's K/V ring: the ``window - 1`` frames a pass's first query
    reads from earlier passes plus the pass's own ``MAX_PASS_FRAMES`` (padding included), so
    that a frame written by a pass — valid or padding, this pass or an earlier one — never
    takes the slot of a frame some valid query still reads; rounded up to 16 (aligned rows for
    the attention kernel)."""
    return -(-(window - 1 + MAX_PASS_FRAMES) // 16) * 16


class Stateful:
    """Mixin for layers that carry per-stream history in streaming mode.

    ``state_key`` is set by the owning :class:`~engine.codec.model.Codec` to the layer's module
    path; the streaming decoder allocates one ``[max_streams, *shape]`` buffer per entry of
    :meth:`state_shapes` and of :meth:`ring_shapes` under the key ``f"{state_key}.{name}"``.
    A pass gathers the streams' rows of the first kind and scatters the new values back
    (`StreamContext.get` / `put`); the second kind stays where it is and the layer reads and
    writes the streams' rows in place (`StreamContext.ring`, `slots`): state of which a
    pass changes a small part.
    """

    state_key: str = ""

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def ring_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


class StreamContext:
    """The streams of one batched streaming call and their gathered state.

    ``lengths``: [B] int64 new code frames per stream (all >= 1); the batch is right-padded to
    ``n_max`` frames. ``positions``: [B] int64 frames each stream had decoded before this call
    (absolute RoPE positions start there). ``max_position``: host-side max of ``positions``
    (so RoPE tables can be sized without a device sync). ``ops``: the pointwise ops the
    streaming layers call (:class:`CodecOps`; the torch formulas by default). ``rings``: the
    decoder's in-place state buffers ([slots, *shape] per key, `Stateful.ring_shapes`) and
    ``slots`` [B] int64 the streams' rows of them.
    """

    def __init__(
        self,
        lengths: Tensor,
        positions: Tensor,
        n_max: int,
        max_position: int,
        state: dict[str, Tensor],
        uniform: bool,
        ops: CodecOps | None = None,
        rings: dict[str, Tensor] | None = None,
        slots: Tensor | None = None,
    ) -> None:
        self.ops = ops if ops is not None else CodecOps()
        self.lengths = lengths
        self.positions = positions
        self.n_max = n_max
        self.max_position = max_position
        self.state = state
        self.new_state: dict[str, Tensor] = {}
        self.uniform = uniform  # every stream has n_max frames: tails are plain slices
        self.rings = rings or {}
        self.slots = slots

    def get(self, layer: Stateful, name: str) -> Tensor:
        return self.state[f"{layer.state_key}.{name}"]

    def ring(self, layer: Stateful, name: str) -> tuple[Tensor, Tensor]:
        """(the decoder's whole buffer [slots, *shape], the streams' rows of it [B])."""
        if self.slots is None:
            raise RuntimeError("this streaming call has no in-place state (rings, slots)")
        return self.rings[f"{layer.state_key}.{name}"], self.slots

    def put(self, layer: Stateful, name: str, value: Tensor) -> None:
        self.new_state[f"{layer.state_key}.{name}"] = value

    def take_last(self, x: Tensor, keep: int, dim: int = -1) -> Tensor:
        """The ``keep`` samples of ``x`` along ``dim`` that end at each stream's valid end.

        ``x`` holds ``keep`` samples of saved history followed by the padded new samples
        (``n_max * rate`` of them), so stream b's valid data ends at ``keep + lengths[b]*rate``.
        """
        dim = dim % x.dim()
        total = x.shape[dim]
        if keep == 0:
            return x.narrow(dim, 0, 0)
        if self.uniform:
            return x.narrow(dim, total - keep, keep)
        return self.ops.take_last(x, self.lengths, keep, (total - keep) // self.n_max, dim)


def stream_sequential(seq: nn.Module, x: Tensor, ctx: StreamContext) -> Tensor:
    """Run an ``nn.Sequential`` (or a single module) in streaming mode (`stream_modules` over
    its children)."""
    return stream_modules(list(seq.children()) if isinstance(seq, nn.Sequential) else [seq],
                          x, ctx)


def _next_conv(mods: list[nn.Module], i: int) -> tuple[Stateful, Tensor] | None:
    """The streaming conv that starts at mods[i] with a Snake before it, and that Snake's
    alpha: a residual unit's first conv, or a Snake + causal (transposed) conv pair whose
    conv keeps a tail (its input is [tail | Snake(x)]); None otherwise."""
    m = mods[i] if i < len(mods) else None
    nxt = mods[i + 1] if i + 1 < len(mods) else None
    if isinstance(m, ResidualUnit):
        return m.block[1], m.block[0].alpha
    if isinstance(m, Snake1d) and isinstance(nxt, CausalConv1d | CausalConvTranspose1d) \
            and nxt.state_shapes():
        return nxt, m.alpha
    return None


def stream_modules(mods: list[nn.Module], x: Tensor, ctx: StreamContext) -> Tensor:
    """Run modules one after another in streaming mode: those with a ``stream`` method
    continue from saved state, the others are pointwise and run as is. A Snake followed by
    a causal (transposed) conv is handed to the conv as its input activation, so the
    activation is written straight into the conv's [tail | new] input (``ctx.ops.snake_cat``)
    instead of being concatenated afterwards; with ``ctx.ops.snake_into_next``, a residual
    unit whose next module starts with such a Snake + conv writes that input itself where
    its last conv runs fused (`ResidualUnit.stream_chain`), and the conv takes it as it is."""
    i, xx = 0, None  # xx: the next conv's input, made by the module before
    while i < len(mods):
        m = mods[i]
        nxt = mods[i + 1] if i + 1 < len(mods) else None
        if isinstance(m, Snake1d) and isinstance(nxt, CausalConv1d | CausalConvTranspose1d):
            x, xx = nxt.stream(x, ctx, act=m.alpha, xx=xx), None
            i += 2
            continue
        if isinstance(m, ResidualUnit):
            then = _next_conv(mods, i + 1) if ctx.ops.snake_into_next else None
            x, xx = m.stream_chain(x, ctx, xx, then)
            i += 1
            continue
        assert xx is None  # made only for a Snake + conv or a residual unit
        x = m.stream(x, ctx) if hasattr(m, "stream") else m(x)
        i += 1
    return x


def take_last(x: Tensor, lengths: Tensor, keep: int, rate: int, dim: int) -> Tensor:
    """The `keep` samples of each stream's row of x along `dim` that end at its valid end:
    x holds `keep` samples of history, then the new samples padded to the pass's longest
    (stream b's valid data ends at keep + lengths[b] * rate). x [B, ...] -> [B, ..., keep, ...]."""
    # idx: [B, keep] the kept window, from lengths * rate (in x's coordinates)
    idx = (lengths * rate)[:, None] + torch.arange(keep, device=x.device)
    shape = [1] * x.dim()
    shape[0], shape[dim] = x.shape[0], keep
    idx = idx.view(shape).expand(*[keep if d == dim else s for d, s in enumerate(x.shape)])
    return torch.gather(x, dim, idx)


def ring_window(positions: Tensor, n: int, ring: int,
                window: int) -> tuple[Tensor, Tensor, Tensor]:
    """A streaming pass of n frames per stream over its attention ring of `ring` slots:
    positions [B] (frames decoded before) -> (pos [B, n]: the new frames' absolute
    positions, at [B, n]: their ring slots, mask [B, 1, n, ring] bool: which slots each new
    frame attends to once the pass has written its frames).

    After the writes (frames positions .. positions + n - 1, padding included) slot s holds
    the latest frame p < end = positions + n with p = s mod ring. A slot whose frame is
    negative was never written (zeros) and is masked out; one holding an older pass's
    padding is taken for a frame far enough back that no valid query reads it
    (`ring_size`). Frame q sees frames q - window < p <= q."""
    pos = positions[:, None] + torch.arange(n, device=positions.device)  # [B, n]
    end = (positions + n)[:, None]  # [B, 1]
    kp = end - 1 - (end - 1 - torch.arange(ring, device=positions.device)).remainder(ring)
    qp, kp = pos[:, :, None], kp[:, None, :]  # [B, n, 1], [B, 1, R]
    mask = (kp <= qp) & (kp > qp - window) & (kp >= 0)  # [B, n, R]
    return pos, pos.remainder(ring), mask[:, None]


# ---------------------------------------------------------------------------------------------
# Snake and the pointwise ops of the streaming path
# ---------------------------------------------------------------------------------------------
snake = snake_formula  # x [B, C, T], alpha [1, C, 1]: x + sin(alpha x)^2 / (alpha + 1e-9)


@dataclass(frozen=True, slots=True)
class CodecOps:
    """The pointwise ops of the streaming decode path, handed to the layers in the
    :class:`StreamContext` (engine/ops.py builds the one-pass csrc versions; the defaults are
    the torch formulas). With ``fold_bias``, a streaming residual unit runs its convs
    without their biases and adds them inside the next pointwise op (cuDNN adds a conv's
    bias as one more broadcast pass). With ``channels_last``, the streaming convs keep their
    activations channels-last (`conv_cl`); the pointwise ops keep each input's layout."""

    snake: Callable[..., Tensor] = snake_torch  # (x, alpha, bias=None): Snake of x (+ bias)
    snake_cat: Callable[..., Tensor] = snake_cat_torch  # (tail, x, alpha): [tail | Snake(x)]
    bias_residual: Callable[..., Tensor] = bias_residual_torch  # (x, y, bias): x + (y + bias)
    fold_bias: bool = False
    # where a residual unit's conv runs as engine/kernels/codec_conv.py's Triton conv with the
    # Snake after it (the first) or the residual sum (the second) in its epilogue, and where
    # the whole unit runs as one launch (`residual_unit`, the plan's `units`); the others as
    # the conv, then the pointwise op (needs fold_bias' ops)
    conv_plan: Plan | None = None
    # with the plan: a residual unit whose last conv runs fused also writes the next conv's
    # [tail | Snake] input in that conv's epilogue (`ResidualUnit.stream_chain`). Off: on the
    # H200, with the hardware sine, within 1 % of the unchained ticks either way (64 x 8
    # 16.09 vs 16.23 ms, 64 x 2 7.81 vs 7.75) at twice the capture time (docs/PERF.md)
    snake_into_next: bool = False
    # the fused convs' Snake epilogues with the hardware sine (as csrc's bf16 Snake pass)
    # instead of Triton's accurate one: a 64 x 8 tick 16.62 -> 16.23 ms on the H200 (the
    # 96-channel convs 0.72 -> 0.50 ms), within 0.031 of the accurate sine (docs/PERF.md)
    conv_fast_sine: bool = True
    # convs as 2-D NHWC convs over channels-last activations ([B, C, T] stored as [B, T, C]):
    # cuDNN's fast kernels are NHWC, and a channels-first conv pays a transpose of its input
    # and of its output (4 of a 64 x 8 tick's 12 ms of convs on the H200)
    channels_last: bool = False
    # the window transformer's pointwise ops on the streaming path (engine/ops.py hands
    # compiled versions of the same functions: eager, a layer is ~45 launches of the small
    # ticks' launch-bound graphs): its RMSNorms, the RoPE of q and k (no q/k norm), the
    # FFN's silu * mul and the LayerScale'd residual adds
    rms_norm: Callable[..., Tensor] = rms_norm  # (x, w, eps)
    norm_rope_qk: Callable[..., tuple[Tensor, Tensor]] = norm_rope_qk  # (q, k, None, None, cs, eps)
    silu_mul: Callable[[Tensor, Tensor], Tensor] = silu_mul  # (a, b): silu(a) * b
    add_scaled: Callable[..., Tensor] = add_scaled  # (x, y, gamma): x + y * gamma
    # (positions, n, ring, window) -> a pass's frame positions, ring slots and mask
    ring_window: Callable[..., tuple[Tensor, Tensor, Tensor]] = ring_window
    # (x, lengths, keep, rate, dim) -> each stream's last `keep` valid samples (a stateful
    # conv's next tail; eager: 4 launches per conv, ~20 convs a pass)
    take_last: Callable[..., Tensor] = take_last
    # the window transformer's FFN as one GEMM over W1 | W3 where fusion.pack_ffn laid them
    # out as one buffer (load_bundle packs every FFN; build_ops sets this with compiled ops)
    packed_ffn: bool = False
    # (codes, tables) -> the quantizer's latent from its codebooks' projected rows in one op
    # (quantizer.lookup_sum); None: each codebook's lookup and 1x1 conv, then the sums
    # (~30 launches a pass)
    lookup_sum: Callable[[Tensor, list[Tensor]], Tensor] | None = None


class Snake1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)

    def stream(self, x: Tensor, ctx: StreamContext) -> Tensor:
        return ctx.ops.snake(x, self.alpha)


# ---------------------------------------------------------------------------------------------
# Causal convolutions
# ---------------------------------------------------------------------------------------------
def _stream_input(tail: Tensor, x: Tensor, act: Tensor | None, ctx: StreamContext) -> Tensor:
    """A streaming conv's input: the saved tail, then the new samples (activated by the
    preceding Snake when ``act`` is its alpha), in x's layout."""
    return cat_time(tail, x) if act is None else ctx.ops.snake_cat(tail, x, act)


def _input_buffer(tail: Tensor, like: Tensor) -> Tensor:
    """[tail | T empty samples] for new samples shaped like ``like`` [B, C, T], in like's
    layout: a streaming conv's input for the module before it to fill."""
    xx = empty_like_layout(like, tail.shape[-1] + like.shape[-1])
    xx[..., : tail.shape[-1]] = tail
    return xx


def _weight_cl(conv: nn.Conv1d | nn.ConvTranspose1d) -> Tensor:
    """The conv's weight as a channels-last 2-D kernel [O, I, 1, k]."""
    return derived(conv.__dict__, "_weight_cl", conv.weight,
                   lambda w: w.unsqueeze(2).contiguous(memory_format=torch.channels_last))


def conv_cl(conv: nn.Conv1d | nn.ConvTranspose1d, x: Tensor, bias: bool = True) -> Tensor:
    """``conv(x)`` for x [B, C, T] as a 2-D conv over [B, C, 1, T] in channels-last memory:
    x channels-last gives a channels-last output with no layout transposes (conv1d makes its
    input contiguous first, so it cannot). Any layout of x gives the same values."""
    w = _weight_cl(conv)
    b = conv.bias if bias else None
    (s,), (p,), (d,) = conv.stride, conv.padding, conv.dilation
    x4 = x.unsqueeze(2)
    if isinstance(conv, nn.ConvTranspose1d):
        y = F.conv_transpose2d(x4, w, b, (1, s), (0, p), (0, conv.output_padding[0]),
                               conv.groups, (1, d))
    else:
        y = F.conv2d(x4, w, b, (1, s), (0, p), (1, d), conv.groups)
    return y.squeeze(2)


class CausalConv1d(Stateful, nn.Module):
    """Conv1d made causal by left padding ``span - stride`` zeros (span = (k-1)*dilation + 1),
    plus right padding that completes the last window (only non-zero for strided convs).

    ``weight_norm`` only records that the reference wraps this conv in weight norm (its
    checkpoint stores g/v, which the loader folds into ``conv.weight``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        weight_norm: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups
        )
        self.stride = stride
        self.span = (kernel_size - 1) * dilation + 1
        self.left_pad = self.span - stride
        self.weight_norm = weight_norm

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, Cin, L] -> [B, Cout, ceil(L / stride)]
        length = x.shape[-1]
        n_out = -(-(length - self.span + self.left_pad) // self.stride) + 1
        right_pad = (n_out - 1) * self.stride + (self.span - self.left_pad) - length
        return self.conv(F.pad(x, (self.left_pad, right_pad)))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.left_pad == 0:
            return {}
        return {"tail": (self.conv.in_channels, self.left_pad)}

    def stream(self, x: Tensor, ctx: StreamContext, act: Tensor | None = None,
               bias: bool = True, xx: Tensor | None = None) -> Tensor:
        # x: [B, Cin, T] new samples (padded) -> [B, Cout, T]; the saved tail replaces the zeros
        # the offline conv pads on the left. act: a preceding Snake's alpha, applied to x first.
        # bias=False: the conv's bias is left out (the caller adds it in a later op). xx: the
        # input already made by the module before (`_input_buffer`, filled).
        return self._conv(self.stream_input(x, ctx, act, xx), bias, ctx)

    def stream_input(self, x: Tensor, ctx: StreamContext, act: Tensor | None = None,
                     xx: Tensor | None = None) -> Tensor:
        """The conv's input for new samples x [B, Cin, T] (activated by a preceding Snake
        when ``act`` is its alpha): [B, Cin, left_pad + T], the saved tail first; the new
        tail is saved. xx: that input already made (`_input_buffer`, its new samples written
        by the module before), taken as it is."""
        if self.stride != 1:
            raise RuntimeError("streaming is only defined for stride-1 causal convs")
        if xx is None:
            if self.left_pad == 0:
                return x if act is None else ctx.ops.snake(x, act)
            xx = _stream_input(ctx.get(self, "tail"), x, act, ctx)  # [B, Cin, left_pad + T]
        ctx.put(self, "tail", ctx.take_last(xx, self.left_pad))
        return xx

    def stream_then(self, x: Tensor, ctx: StreamContext, act: Tensor | None = None, *,
                    alpha: Tensor | None = None, residual: Tensor | None = None,
                    xx: Tensor | None = None) -> Tensor:
        """``stream`` with the conv's bias, then the Snake with ``alpha`` or the sum with
        ``residual``: in one pass where ``ctx.ops.conv_plan`` chose the fused conv for this
        shape, else the conv without its bias and the pointwise op adding it."""
        return self.stream_sum_then(x, ctx, act, alpha=alpha, residual=residual, xx=xx)[0]

    def stream_sum_then(self, x: Tensor, ctx: StreamContext, act: Tensor | None = None, *,
                        alpha: Tensor | None = None, residual: Tensor | None = None,
                        xx: Tensor | None = None,
                        then: tuple[Stateful, Tensor] | None = None
                        ) -> tuple[Tensor, Tensor | None]:
        """`stream_then`; with ``residual`` and ``then`` = (the next streaming conv, the
        Snake's alpha before it), where the fused conv runs it also writes that Snake of
        its output into the next conv's `_input_buffer` in the same pass, which it returns
        (filled) with the output (None where it does not: the next conv makes its input)."""
        c, ops = self.conv, ctx.ops
        assert ops.conv_plan is not None and c.bias is not None and c.groups == 1
        xx = self.stream_input(x, ctx, act, xx)
        (k,), (d,) = c.kernel_size, c.dilation
        t = xx.shape[-1] - (k - 1) * d
        cfg = ops.conv_plan.choose(c.in_channels, k, d, xx.shape[0] * t)
        # the kernel where it takes these tensors; its formulas on a CPU (the same call path);
        # a CUDA input it does not take (float32) keeps cuDNN's conv below
        if cfg is not None and (not xx.is_cuda or causal_conv_supported(xx, c.weight, residual)):
            nxt = None
            if then is not None and residual is not None:
                consumer, alpha2 = then
                # [consumer's tail | T samples to fill] in the output's (residual's) layout
                buf = _input_buffer(ctx.get(consumer, "tail"), residual)
                if not xx.is_cuda or causal_conv_supported(xx, c.weight, residual, buf):
                    nxt = (buf, alpha2)
            y = causal_conv(xx, c.weight, c.bias, d, alpha=alpha, residual=residual,
                            next_input=nxt, taps=derived(c.__dict__, "_conv_taps", c.weight, conv_taps),
                            config=cfg, fast_sine=ops.conv_fast_sine)
            return y, nxt[0] if nxt is not None else None
        y = self._conv(xx, False, ctx)
        if alpha is not None:
            return ops.snake(y, alpha, c.bias), None
        assert residual is not None
        return ops.bias_residual(residual, y, c.bias), None

    def _conv(self, x: Tensor, bias: bool, ctx: StreamContext) -> Tensor:
        c = self.conv
        if ctx.ops.channels_last:
            return conv_cl(c, x, bias)
        if bias:
            return c(x)
        return F.conv1d(x, c.weight, None, c.stride, c.padding, c.dilation, c.groups)


class CausalConvTranspose1d(Stateful, nn.Module):
    """ConvTranspose1d made causal by trimming ``kernel - stride`` samples from the right end.

    Output sample t gets contributions from inputs j with j*stride <= t < j*stride + kernel, so
    in streaming the last ``ceil((kernel - stride) / stride)`` inputs are kept and fed again.
    Weight norm (when the reference uses it) is per INPUT channel (dim 0 of [in, out, k]).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        weight_norm: bool = False,
    ) -> None:
        super().__init__()
        if kernel_size < stride:
            raise ValueError(f"kernel_size ({kernel_size}) must be >= stride ({stride})")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.kernel_size = kernel_size
        self.trim = kernel_size - stride
        self.history = -(-self.trim // stride)  # inputs whose outputs overlap future outputs
        self.weight_norm = weight_norm

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, Cin, L] -> [B, Cout, L * stride]
        y = self.conv(x)  # [B, Cout, (L-1)*stride + kernel]
        return y[..., : y.shape[-1] - self.trim]

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.history == 0:
            return {}
        return {"tail": (self.conv.in_channels, self.history)}

    def stream(self, x: Tensor, ctx: StreamContext, act: Tensor | None = None,
               xx: Tensor | None = None) -> Tensor:
        # x: [B, Cin, T] -> [B, Cout, T * stride]; act: a preceding Snake's alpha; xx: the
        # input already made by the module before (`_input_buffer`, filled)
        conv = (lambda v: conv_cl(self.conv, v)) if ctx.ops.channels_last else self.conv
        if self.history == 0:
            y = conv(x if act is None else ctx.ops.snake(x, act))
            return y[..., : y.shape[-1] - self.trim]
        if xx is None:
            xx = _stream_input(ctx.get(self, "tail"), x, act, ctx)  # [B, Cin, history + T]
        ctx.put(self, "tail", ctx.take_last(xx, self.history))
        c, plan = self.conv, ctx.ops.conv_plan
        cfg = (plan.choose_up(c.in_channels, self.kernel_size, self.stride,
                              x.shape[0] * x.shape[-1])
               if plan is not None and c.bias is not None and c.groups == 1 else None)
        # as a conv over the input (codec_conv.upsample) where the plan measured it faster;
        # its formulas on a CPU; a CUDA input the kernel does not take keeps cuDNN's
        if cfg is not None and (not xx.is_cuda or causal_conv_supported(xx, c.weight)):
            s = self.stride
            return upsample(xx, c.weight, c.bias, s, config=cfg,
                            taps=derived(c.__dict__, "_up_taps", c.weight,
                                         lambda v: conv_taps(transposed_weight(v, s))),
                            bias_rows=derived(c.__dict__, "_up_bias", c.bias,
                                              lambda v: v.repeat(s)))
        y = conv(xx)  # [B, Cout, (history + T - 1)*stride + kernel]
        start = self.history * self.stride  # outputs of the tail alone were emitted last call
        return y[..., start : start + x.shape[-1] * self.stride]


# ---------------------------------------------------------------------------------------------
# Residual unit and ConvNeXt block
# ---------------------------------------------------------------------------------------------
class ResidualUnit(nn.Module):
    """x + conv1(snake(conv7_dilated(snake(x)))), all causal."""

    def __init__(self, dim: int, dilation: int = 1) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            CausalConv1d(dim, dim, kernel_size=7, dilation=dilation, weight_norm=True),
            Snake1d(dim),
            CausalConv1d(dim, dim, kernel_size=1, weight_norm=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.block(x)
        trim = x.shape[-1] - y.shape[-1]  # 0 for the causal unit; kept for fidelity
        if trim > 0:
            x = x[..., :-trim]
        return x + y

    def stream(self, x: Tensor, ctx: StreamContext) -> Tensor:
        return self.stream_chain(x, ctx)[0]

    def stream_chain(self, x: Tensor, ctx: StreamContext, xx: Tensor | None = None,
                     then: tuple[Stateful, Tensor] | None = None
                     ) -> tuple[Tensor, Tensor | None]:
        """`stream`, where ``xx`` (when given) is the first conv's input already made (the
        module before wrote Snake(x) into its `_input_buffer`) and ``then`` = (the next
        module's streaming conv, the Snake before it): where this unit's last conv runs
        fused, it writes that Snake of the unit's output into the next conv's input in the
        same pass and returns it beside the output (else None), which saves the next conv's
        Snake-and-concatenate pass. Where the plan has a row for the fused unit at this
        shape, both convs run as one launch (`residual_unit`; no `then`)."""
        act1, conv7, act2, conv1 = self.block
        ops = ctx.ops
        if ops.conv_plan is not None and conv7.conv.bias is not None \
                and conv1.conv.bias is not None:
            c7, c1 = conv7.conv, conv1.conv
            cfg = ops.conv_plan.choose_unit(c7.in_channels, c7.dilation[0],
                                            x.shape[0] * x.shape[-1])
            # the whole unit in one launch where the plan measured it faster (its formulas
            # on a CPU); a CUDA input the kernel does not take keeps the convs (the conv's
            # input is made in x's layout, so x decides)
            if cfg is not None and c7.groups == 1 and c1.groups == 1 \
                    and (not x.is_cuda or unit_supported(x, x)):
                xx = conv7.stream_input(x, ctx, act1.alpha, xx)
                return residual_unit(
                    x, xx, c7.weight, c7.bias, c7.dilation[0], act2.alpha, c1.weight, c1.bias,
                    taps7=derived(c7.__dict__, "_conv_taps", c7.weight, conv_taps),
                    taps1=derived(c1.__dict__, "_conv_taps", c1.weight, conv_taps),
                    config=cfg, fast_sine=ops.conv_fast_sine), None
            # conv7 + bias + Snake, then conv1 + bias + the residual sum (each one pass where
            # the plan chose the fused conv)
            h = conv7.stream_then(x, ctx, act1.alpha, alpha=act2.alpha, xx=xx)
            return conv1.stream_sum_then(h, ctx, residual=x, then=then)
        if not (ops.fold_bias and conv7.conv.bias is not None and conv1.conv.bias is not None):
            y = conv7.stream(x, ctx, act=act1.alpha, xx=xx)
            return x + stream_sequential(self.block[2:], y, ctx), None
        # the same math with both conv biases folded into the pointwise ops after them
        y = conv7.stream(x, ctx, act=act1.alpha, bias=False, xx=xx)
        y = conv1.stream(ops.snake(y, act2.alpha, conv7.conv.bias), ctx, bias=False)
        return ops.bias_residual(x, y, conv1.conv.bias), None


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm(eps 1e-6) -> Linear 4x -> GELU(erf) -> Linear
    -> * gamma, plus the input."""

    def __init__(self, dim: int, mlp_ratio: float = 4.0, kernel_size: int = 7) -> None:
        super().__init__()
        hidden = int(mlp_ratio * dim)
        self.dwconv = CausalConv1d(dim, dim, kernel_size=kernel_size, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, hidden)
        self.pwconv2 = nn.Linear(hidden, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def _pointwise(self, x: Tensor) -> Tensor:
        # x: [B, C, T] -> [B, C, T] (the per-time-step MLP branch)
        x = x.permute(0, 2, 1)  # [B, T, C]
        x = self.pwconv2(F.gelu(self.pwconv1(self.norm(x))))
        x = self.gamma * x
        return x.permute(0, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self._pointwise(self.dwconv(x))

    def stream(self, x: Tensor, ctx: StreamContext) -> Tensor:
        return x + self._pointwise(self.dwconv.stream(x, ctx))


# ---------------------------------------------------------------------------------------------
# Transformer (window-limited, causal)
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float = 1e-2) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(Stateful, nn.Module):
    """Multi-head attention with fused [q|k|v] projection, RoPE on q/k, SDPA with a bool mask."""

    def __init__(self, dim: int, n_head: int, head_dim: int, window: int | None) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = head_dim
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)
        self.window = window

    def _qkv(self, x: Tensor, rope: Tensor,
             ops: CodecOps | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, T, D] -> q, k, v: [B, H, T, hd] (q, k rotated; `ops`: the streaming path's)
        bsz, seqlen, _ = x.shape
        size = self.n_head * self.head_dim
        q, k, v = self.wqkv(x).split([size, size, size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_head, self.head_dim)
        v = v.view(bsz, seqlen, self.n_head, self.head_dim)
        if ops is None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        else:  # the same rotation of both (no q/k norm weights), one op
            q, k = ops.norm_rope_qk(q, k, None, None, rope, 0.0)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _out(self, y: Tensor) -> Tensor:
        # y: [B, H, T, hd] -> [B, T, D]
        bsz, _, seqlen, _ = y.shape
        return self.wo(
            y.transpose(1, 2).contiguous().view(bsz, seqlen, self.n_head * self.head_dim)
        )

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        # x: [B, T, D], rope: [1, T, hd/2, 2], mask: [1, 1, T, T] bool (True = attend)
        q, k, v = self._qkv(x, rope)
        return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def ring_shapes(self) -> dict[str, tuple[int, ...]]:
        # [R, H, hd] per stream: a frame's heads side by side, so that a pass writes each new
        # frame's k (or v) [H, hd] as one row of the ring
        if self.window is None:
            raise RuntimeError("streaming attention needs a window size")
        ring = ring_size(self.window)
        return {"k": (ring, self.n_head, self.head_dim), "v": (ring, self.n_head, self.head_dim)}

    def stream(self, x: Tensor, rope: Tensor, mask: Tensor, at: Tensor,
               ctx: StreamContext) -> Tensor:
        # x: [B, n, D]; rope: [B, n, hd/2, 2]; mask: [B, 1, n, R] bool over the ring's slots
        # after this pass's writes; at: [B, n] int64, each new frame's ring slot
        q, k, v = self._qkv(x, rope, ctx.ops)  # [B, H, n, hd]
        out = []
        for name, new in (("k", k), ("v", v)):
            buf, slots = ctx.ring(self, name)  # [S, R, H, hd], [B]
            buf[slots[:, None], at] = new.transpose(1, 2)  # the new frames, in place
            out.append(buf.index_select(0, slots).transpose(1, 2))  # [B, H, R, hd]
        return self._out(F.scaled_dot_product_attention(q, out[0], out[1], attn_mask=mask))


class TransformerBlock(nn.Module):
    """Pre-norm block with LayerScale on both residual branches."""

    def __init__(
        self, dim: int, n_head: int, head_dim: int, hidden: int, eps: float, window: int | None
    ) -> None:
        super().__init__()
        self.attention = Attention(dim, n_head, head_dim, window)
        self.feed_forward = FeedForward(dim, hidden)
        self.ffn_norm = RMSNorm(dim, eps)
        self.attention_norm = RMSNorm(dim, eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def _ffn(self, h: Tensor) -> Tensor:
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), rope, mask))
        return self._ffn(h)

    def stream(self, x: Tensor, rope: Tensor, mask: Tensor, at: Tensor,
               ctx: StreamContext) -> Tensor:
        # forward's math through the streaming ops (ctx.ops), op for op
        ops, an, fn, ff = ctx.ops, self.attention_norm, self.ffn_norm, self.feed_forward
        a = self.attention.stream(ops.rms_norm(x, an.weight, an.eps), rope, mask, at, ctx)
        h = ops.add_scaled(x, a, self.attention_layer_scale.gamma)
        n = ops.rms_norm(h, fn.weight, fn.eps)
        w13 = packed(ff.w1.weight, ff.w3.weight) if ops.packed_ffn else None
        if w13 is None:
            g = ops.silu_mul(ff.w1(n), ff.w3(n))
        else:  # W1 | W3 laid out as one buffer (fusion.pack_ffn): one GEMM for both
            up = F.linear(n, w13)  # [B, n, 2 * hidden]
            g = ops.silu_mul(*up.split(ff.w1.weight.shape[0], dim=-1))
        return ops.add_scaled(h, ff.w2(g), self.ffn_layer_scale.gamma)


def _time_major(x: Tensor) -> Tensor:
    # [B, C, T] -> contiguous [B, T, C]. A transposed view would carry its layout through every
    # residual add, so each norm output fed to a GEMM would have a leading dimension of T: at
    # T = 2 frames cuBLAS falls back to a 2-element-aligned kernel (3.3 of a 64x2 tick's 15 ms)
    return x.transpose(1, 2).contiguous()


class WindowLimitedTransformer(nn.Module):
    """Causal transformer over [B, C, T] (channels first) where frame i attends to frames
    max(0, i-window+1)..i (all earlier frames when ``window_size`` is None)."""

    def __init__(self, cfg: WindowTransformerConfig) -> None:
        super().__init__()
        c = cfg.config
        self.window_size = cfg.window_size
        self.head_dim = c.head_dim
        self.rope_base = float(c.rope_base)
        self.layers = nn.ModuleList(
            TransformerBlock(
                c.dim, c.n_head, c.head_dim, c.intermediate_size, c.norm_eps, cfg.window_size
            )
            for _ in range(c.n_layer)
        )
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.input_proj = (
            nn.Linear(cfg.input_dim, c.dim) if cfg.input_dim != c.dim else nn.Identity()
        )
        self.output_proj = (
            nn.Linear(c.dim, cfg.input_dim) if cfg.input_dim != c.dim else nn.Identity()
        )
        # RoPE table for the configured block size, built on first use and grown on demand
        # (same formula per position, so a longer table has identical leading rows). Kept out of
        # the state dict and out of .to(dtype): it must stay float32 holding bf16 values.
        self.block_size = c.block_size
        self._rope_cpu: Tensor | None = None
        self._rope_dev: Tensor | None = None
        # Tables replaced by a larger one stay alive: a CUDA graph captured earlier keeps
        # reading the one it was captured with (same leading rows), never freed memory.
        self._rope_old: list[Tensor] = []

    def rope_rows(self, n_positions: int, device: torch.device) -> Tensor:
        """The RoPE table ([>= n_positions, hd/2, 2], float32) on ``device``."""
        if self._rope_cpu is None or n_positions > self._rope_cpu.shape[0]:
            size = max(
                n_positions,
                self.block_size,
                2 * (0 if self._rope_cpu is None else self._rope_cpu.shape[0]),
            )
            self._rope_cpu = rope_table(size, self.head_dim, self.rope_base).float()
            if self._rope_dev is not None and self._rope_dev.is_cuda:
                self._rope_old.append(self._rope_dev)
            self._rope_dev = None
        if self._rope_dev is None or self._rope_dev.device != device:
            if self._rope_dev is not None and self._rope_dev.is_cuda:
                self._rope_old.append(self._rope_dev)
            self._rope_dev = self._rope_cpu.to(device)
        return self._rope_dev

    def window_mask(self, length: int, device: torch.device) -> Tensor:
        # [1, 1, T, T] bool: key j visible from query i iff i-window < j <= i
        i = torch.arange(length, device=device)[:, None]
        j = torch.arange(length, device=device)[None, :]
        mask = j <= i
        if self.window_size is not None:
            mask = mask & (j > i - self.window_size)
        return mask[None, None]

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, T] -> [B, C, T]
        x = self.input_proj(_time_major(x))  # [B, T, D]
        length = x.shape[1]
        rope = self.rope_rows(length, x.device)[:length][None]  # [1, T, hd/2, 2]
        mask = self.window_mask(length, x.device)
        for layer in self.layers:
            x = layer(x, rope, mask)
        x = self.output_proj(self.norm(x))
        return x.transpose(1, 2)

    def stream(self, x: Tensor, ctx: StreamContext) -> Tensor:
        # x: [B, C, n] new frames (padded to ctx.n_max) -> [B, C, n]
        if self.window_size is None:
            raise RuntimeError("streaming needs a window-limited transformer")
        x = self.input_proj(_time_major(x))  # [B, n, D]
        n = x.shape[1]
        if n > MAX_PASS_FRAMES:
            raise ValueError(f"a streaming pass carries at most {MAX_PASS_FRAMES} frames, got {n}")
        table = self.rope_rows(ctx.max_position + ctx.n_max, x.device)
        pos, at, mask = ctx.ops.ring_window(ctx.positions, n, ring_size(self.window_size),
                                            self.window_size)
        rope = table[pos]  # [B, n, hd/2, 2]
        for layer in self.layers:
            x = layer.stream(x, rope, mask, at, ctx)
        x = self.output_proj(ctx.ops.rms_norm(x, self.norm.weight, self.norm.eps))
        return x.transpose(1, 2)
