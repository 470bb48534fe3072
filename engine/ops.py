"""The kernels one engine runs, chosen once: `build_ops(...)` makes an `Ops` when the engine
is built, and the engine hands it to the runner (model calls, attention, sampler) and to
its codec worker (the streaming decoder's pointwise ops). The model and the codec keep the
plain math (engine/functional.py, engine/kernels/activation.py) as the defaults; no module
state decides which kernel runs, so two engines in one process can run different ops.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from . import functional, fusion, quant
from .bookkeeping import Bookkeeping
from .codec.layers import CodecOps
from .codec.quantizer import lookup_sum
from .config import DECODE_ROPE_ROWS
from .kernels import (
    act_quant,
    activation,
    codec_conv,
    extension_available,
    linear,
    qk_rope,
    sampling,
    step_book,
)
from .kernels.decode_attention import decode_attention
from .kernels.fp8_triton import QuantAct
from .kernels.prev_tokens import prev_tokens_shift_checked, prev_tokens_shift_inplace
from .quant import Fp8Weight

FUSED_MODES = ("auto", "compile", "reference")


@dataclass(frozen=True, slots=True)
class Normed:
    """rms_norm(h) * weight, not computed yet: a projection that can read it (csrc's normed
    prologue: `Ops.project`, `Ops.swiglu`) normalises h on the way in, which saves the norm's
    own launch; anything else takes `Ops.dense` of it first. h: [..., D]."""

    h: Tensor
    weight: Tensor
    eps: float


@dataclass(frozen=True, slots=True)
class PendingHeads:
    """One position's attention output, not computed yet: the output projection that can take
    it (csrc's attention prologue: `Ops.linear_add_rms_norm` with `Ops.attend_kernel`) attends
    on the way in, which saves the attention's own launch; anything else takes `Ops.dense` of
    it (`compute`: the attention the usual way). Offered by an attend whose context is a few
    positions (the fast AR's `FastKV.defer`)."""

    qkv: Tensor  # [B, 1, q_size + 2 kv_size]: the position's projections, q/k not rotated
    k_cache: Tensor  # [rows, Hkv, S, Dh]: the layer's keys (row b's positions < pos read, pos written)
    v_cache: Tensor  # its values, same shape
    cs: Tensor  # [Dh/2, 2]: the rotation at pos (every row at this one position)
    pos: int
    compute: Callable[[], Tensor]  # -> the heads' output [B, 1, q_size], stored k/v included


@dataclass(frozen=True, slots=True)
class PendingGate:
    """The FFN's gated input silu(a) * b, not computed yet: the w2 projection that can take
    its activations quantised (`Ops.prequant`) has the gate quantise them in its own launch
    (`Ops.silu_mul_quant`); anything else takes `Ops.dense` of it (the silu * mul). a, b:
    [..., I], the packed projection's two halves."""

    a: Tensor
    b: Tensor


@dataclass(frozen=True, slots=True)
class PendingGlu:
    """The FFN's gated input from a prequantised w13 GEMM not run yet: x quantised (`xa`,
    by the norm before it) and the packed [W1; W3]. Where w2 reads prequantised rows too,
    w13's GEMM forms the gate and quantises it in its epilogue (`Ops.glu_quant`: no bf16
    gate at all: `glu`, the GLU GEMM looked up for these rows); anything else runs `gemm`
    and takes the gate as a `PendingGate`. rows: a tensor of the FFN input's rows (for w2's
    per-shape lookup)."""

    xa: QuantAct
    w13: Fp8Weight
    gemm: Callable[..., Tensor]
    glu: Callable[..., object]
    rows: Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class Ops:
    """Every swappable piece of the decode and prefill math. Defaults: the reference torch
    functions (what the fixtures check), no csrc kernel."""

    fused: str = "reference"  # "compile": the elementwise ops below are torch.compile'd
    # x [..., K] @ w [N, K]^T, for dense weights and FP8 ones (engine/quant.py)
    linear: Callable[[Tensor, Tensor | Fp8Weight], Tensor] = quant.linear
    rms_norm: Callable[..., Tensor] = functional.rms_norm
    add_rms_norm: Callable[..., tuple[Tensor, Tensor]] = functional.add_rms_norm
    norm_rope_qk: Callable[..., tuple[Tensor, Tensor]] = functional.norm_rope_qk
    silu_mul: Callable[[Tensor, Tensor], Tensor] = functional.silu_mul
    # the slow AR's input embedding of a frame column (eager: ~11 launches of a decode step)
    embed_columns: Callable[..., Tensor] = functional.embed_columns
    # one GEMM over W1|W3 where fusion.pack_ffn laid them out as one buffer
    packed_ffn: bool = False
    # a head over row ranges of one weight (`rows_linear`) as one GEMM over a packed copy of
    # them (fusion.gathered_rows), not one GEMM per range and a concatenation
    packed_heads: bool = False
    # (x, [W1; W3]) -> silu(x W1^T) * (x W3^T) in one launch (csrc's SwiGLU epilogue), or
    # None where it does not take the call; None: always the linear, then silu_mul
    swiglu_kernel: Callable[[Tensor, Tensor | Fp8Weight], Tensor | None] | None = None
    # (y, W, r) -> r + y W^T in one launch (csrc's residual epilogue), or None where it does
    # not take the call; None: the linear, then the add (fused with the norm after it)
    residual_kernel: Callable[[Tensor, Tensor | Fp8Weight, Tensor], Tensor | None] | None = None
    # (h, norm weight, eps, W, glu) -> rms_norm(h) W^T (glu: the SwiGLU of [W1; W3]) in one
    # launch (csrc's normed prologue), or None where it does not take the call; None: norms
    # are computed when made (`pending_norm` gives a dense tensor)
    normed_kernel: Callable[..., Tensor | None] | None = None
    # (qkv, k_cache, v_cache, cs, pos, W, r) -> r + attend(qkv) W^T in one launch (csrc's
    # attention prologue: a `PendingHeads`' attention and its output projection), or None
    # where it does not take the call; None: the attention, then the projection
    attend_kernel: Callable[..., Tensor | None] | None = None
    # csrc's one-position attention (store k/v + attend, one launch); None: the model's
    # attention over the cache (write, then SDPA)
    decode_attention: Callable[..., Tensor] | None = None
    # the most rows of a decode step whose q/k norm + RoPE are folded into decode_attention's
    # launch (its `rope`; 0: never): 76 launches fewer per frame step, 1-2 % faster at 1-2
    # rows and slower at 64 (H200, docs/PERF.md)
    decode_rope: int = 0
    # the same for the fast AR's decode attention (its own knob: folding at many rows measured
    # slower there with csrc's kernel, while the slow AR's Triton kernel may gain from it)
    decode_rope_fast: int = 0
    # decode steps on the Triton attention read a voice prefix that several speaking rows
    # share once per tile of rows (the runner plans the tiles: engine/shared_prefix.py)
    shared_prefix: bool = False
    # csrc's step kernels launched with programmatic dependent launch (sm_90+): each may start
    # while the kernel before it ends (csrc/launch.cuh); recorded here for describe()
    pdl: bool = False
    # the recorded per-shape table by which FP8 linears run their dequantised bf16 copies
    # (Fp8Weight.dense) where it measured bf16 faster; the engine makes the copies where it
    # says they pay (dense_pays). None: the ops take no copies (and none are made)
    dense_plan: linear.LinearPlan | None = None
    # with fp8_activations, the same table, by which FP8 linears run the rowwise-scaled W8A8
    # GEMM on rowwise copies of their weights where it measured fastest; the engine makes
    # the copies where it says they pay (rowwise_pays). None: no rowwise copies
    rowwise_plan: linear.LinearPlan | None = None
    # with fp8_activations: (x, W) -> the W8A8 GEMM over activations their producer
    # quantised (fn(QuantAct, W, residual)) where the table runs this linear as the
    # prequantised W8A8 GEMM at x's rows, else None (linear.make_prequant); None: never.
    # The norm before wqkv / w13 and the gate before w2 then quantise in their own launch
    prequant: Callable[[Tensor, Tensor | Fp8Weight], Callable[..., Tensor] | None] | None = None
    norm_quant: Callable[..., QuantAct] = act_quant.rms_norm_quant  # (h, w, eps) -> QuantAct
    silu_mul_quant: Callable[[Tensor, Tensor], QuantAct] = act_quant.silu_mul_quant
    # with prequant: (x, w13) -> w13's W8A8 GEMM with the gate and its quantisation in the
    # epilogue (fn(QuantAct, w13) -> QuantAct) where it can run w13 at x's rows, else None
    # (linear.make_glu); taken where w2 reads prequantised rows too. None: never
    glu_quant: Callable[[Tensor, Tensor | Fp8Weight], Callable[..., object] | None] | None \
        = None
    sample: Callable[..., Tensor] = sampling.sample  # the sampler's draw
    # the draw and the drawn ids' rows of an embedding table (the fast AR's next input) ->
    # (ids, rows): one launch with csrc's kernel, where the draw and a lookup are two
    sample_embed: Callable[..., tuple[Tensor, Tensor]] = sampling.sample_embed
    shift_window: Callable[[Tensor, Tensor], None] = prev_tokens_shift_checked  # RAS window
    codec: CodecOps = field(default_factory=CodecOps)
    # the step's per-row bookkeeping and the RAS choice (engine/bookkeeping.py)
    book: Bookkeeping = field(default_factory=Bookkeeping)

    @property
    def fp8_dense(self) -> bool:
        """Whether FP8 linears take their dense copies (`dense_plan`)."""
        return self.dense_plan is not None

    def pending_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor | Normed:
        """rms_norm(x) * w for a projection to read: left pending (`Normed`) where a normed
        kernel or a prequantised GEMM may take it, else computed now."""
        if self.normed_kernel is not None or self.prequant is not None:
            return Normed(x, w, eps)
        return self.rms_norm(x, w, eps)

    def dense(self, x: Tensor | Normed | PendingHeads | PendingGate | PendingGlu) -> Tensor:
        """x as a tensor: a pending norm, attention or gate computed now."""
        if isinstance(x, PendingHeads):
            return x.compute()
        if isinstance(x, PendingGlu):
            x = self._gate(x)
        if isinstance(x, PendingGate):
            return self.silu_mul(x.a, x.b)
        return self.rms_norm(x.h, x.weight, x.eps) if isinstance(x, Normed) else x

    def _normed(self, x: Normed, w: Tensor | Fp8Weight | None, glu: bool) -> Tensor | None:
        """The normed kernel's answer for a pending norm x and W (None: it does not take it)."""
        if w is None or self.normed_kernel is None:
            return None
        return self.normed_kernel(x.h, x.weight, x.eps, w, glu)

    @staticmethod
    def _halves(h: Tensor) -> PendingGate:
        """The packed projection's output h [..., 2I] as its gate and up halves, the silu *
        mul still to apply."""
        n = h.shape[-1] // 2
        return PendingGate(h[..., :n], h[..., n:])

    def _gate(self, x: PendingGlu) -> PendingGate:
        """A pending w13 GEMM run: its halves."""
        return self._halves(x.gemm(x.xa, x.w13))

    def _glu_into(self, x: PendingGlu, w: Tensor | Fp8Weight,
                  residual: Tensor | None = None) -> Tensor | None:
        """x's gate times W^T (+ residual) with w13's GEMM forming the gate and quantising it
        in its epilogue, where W reads prequantised rows and the GLU GEMM runs w13 here;
        None otherwise."""
        gemm = self.prequant(x.rows, w) if self.prequant is not None else None
        if gemm is None:
            return None
        return self._product(gemm, x.glu(x.xa, x.w13), w, residual)

    @staticmethod
    def _product(gemm: Callable[..., Tensor], xa: QuantAct, w: Tensor | Fp8Weight,
                 residual: Tensor | None) -> Tensor:
        """gemm(xa, W) with the residual in its epilogue where the call's residual meets the
        GEMM's contract, else added after it."""
        if residual is not None:
            try:  # the wrapper checks its contract before it launches anything
                return gemm(xa, w, residual=residual)
            except ValueError:  # a residual the epilogue cannot read (strides, alignment)
                return residual + gemm(xa, w)
        return gemm(xa, w)

    def _quantised(self, x: Normed | PendingGate, w: Tensor | Fp8Weight | None,
                   residual: Tensor | None = None) -> Tensor | None:
        """x W^T (+ residual) from the prequantised W8A8 GEMM, x quantised by the launch that
        makes it (the norm, or the gate), where `prequant` says this linear runs that GEMM
        here; None otherwise."""
        if w is None or self.prequant is None:
            return None
        rows = x.h if isinstance(x, Normed) else x.a
        gemm = self.prequant(rows, w)
        if gemm is None:
            return None
        xa = (self.norm_quant(x.h, x.weight, x.eps) if isinstance(x, Normed)
              else self.silu_mul_quant(x.a, x.b))
        return self._product(gemm, xa, w, residual)

    def project(self, x: Tensor | Normed | PendingGate | PendingGlu,
                w: Tensor | Fp8Weight) -> Tensor:
        """x [..., K] @ W^T where x may be a pending norm (the normed kernel's prologue applies
        it where it takes the call) or gate (quantised in its own launch, or in w13's
        epilogue, where the GEMM reads quantised activations)."""
        if isinstance(x, PendingGlu):
            y = self._glu_into(x, w)
            if y is not None:
                return y
            x = self._gate(x)
        if isinstance(x, (Normed, PendingGate)):
            y = self._normed(x, w, glu=False) if isinstance(x, Normed) else None
            if y is None:
                y = self._quantised(x, w)
            if y is not None:
                return y
            x = self.dense(x)
        return self.linear(x, w)

    def linear_add_rms_norm(self, y: Tensor | PendingHeads | PendingGate | PendingGlu,
                            w: Tensor | Fp8Weight, x: Tensor, nw: Tensor,
                            eps: float) -> tuple[Tensor, Tensor | Normed]:
        """A residual block's output: (h, rms_norm(h) * nw) for h = x + y W^T. With csrc's
        kernels the add runs in the projection's epilogue and the norm is left pending for
        the next projection's prologue (no launch of its own), a pending attention y is
        computed in its prologue (`attend_kernel`), and a pending gate y quantised in its
        own launch for a prequantised GEMM; else the projection, then the add and the norm
        in one fused op."""
        if isinstance(y, PendingGlu):
            h = self._glu_into(y, w, residual=x)
            if h is not None:
                return h, self.pending_norm(h, nw, eps)
            y = self._gate(y)
        if isinstance(y, PendingGate):
            h = self._quantised(y, w, residual=x)
            if h is not None:
                return h, self.pending_norm(h, nw, eps)
            y = self.dense(y)
        if isinstance(y, PendingHeads):
            h = (self.attend_kernel(y.qkv, y.k_cache, y.v_cache, y.cs, y.pos, w, x)
                 if self.attend_kernel is not None else None)
            if h is not None:
                return h, self.pending_norm(h, nw, eps)
            y = y.compute()
        if self.residual_kernel is not None:
            h = self.residual_kernel(y, w, x)
            if h is not None:
                return h, self.pending_norm(h, nw, eps)
        return self.add_rms_norm(x, self.linear(y, w), nw, eps)

    def rows_linear(self, x: Tensor, w: Tensor, rows: tuple[tuple[int, int], ...]) -> Tensor:
        """x [..., K] @ [w[a0:b0]; w[a1:b1]; ...]^T -> [..., sum of (b - a)]."""
        if self.packed_heads:
            return self.linear(x, fusion.gathered_rows(w, rows))
        return torch.cat([self.linear(x, w[a:b]) for a, b in rows], dim=-1)

    def swiglu(self, x: Tensor | Normed, w1: Tensor, w3: Tensor
               ) -> Tensor | PendingGate | PendingGlu:
        """The FFN's gated input: silu(x W1^T) * (x W3^T). x: [..., D] (or a pending norm)
        -> [..., I], left pending (`PendingGate`, or `PendingGlu` before w13's GEMM) where a
        prequantised GEMM may read it."""
        w13 = fusion.packed(w1, w3) if self.packed_ffn else None
        if isinstance(x, Normed):
            y = self._normed(x, w13, glu=True)
            if y is not None:
                return y
            gemm = (self.prequant(x.h, w13) if self.prequant is not None and w13 is not None
                    else None)
            if gemm is not None:  # the norm quantises x for w13's prequantised GEMM
                xa = self.norm_quant(x.h, x.weight, x.eps)
                glu = self.glu_quant(x.h, w13) if self.glu_quant is not None else None
                if glu is not None:
                    return PendingGlu(xa, w13, gemm, glu, x.h)
                return self._halves(gemm(xa, w13))
            x = self.dense(x)
        if w13 is None:
            return self.silu_mul(self.linear(x, w1), self.linear(x, w3))
        if self.swiglu_kernel is not None:
            y = self.swiglu_kernel(x, w13)
            if y is not None:
                return y
        h = self.linear(x, w13)  # [..., 2I]: the gate and the up projection side by side
        if self.prequant is not None:
            return self._halves(h)
        n = w1.shape[0]
        return self.silu_mul(h[..., :n], h[..., n:])

    @property
    def attention_triton_rows(self) -> int:
        """From how many rows decode attention runs the Triton kernel (0: never)."""
        k = self.decode_attention
        return k.keywords.get("triton_rows", 0) if isinstance(k, functools.partial) else 0

    def describe(self) -> dict[str, object]:
        """What runs, for logs and bench reports."""
        return {"fused": self.fused, "linear": getattr(self.linear, "__name__", str(self.linear)),
                "decode_attention": self.decode_attention is not None,
                "attention_triton_rows": self.attention_triton_rows,
                "decode_rope": self.decode_rope,
                "decode_rope_fast": self.decode_rope_fast,
                "shared_prefix": self.shared_prefix,
                "pdl": self.pdl,
                "sampler": getattr(self.sample, "__name__", str(self.sample)),
                "sampler_embed": getattr(self.sample_embed, "__name__", str(self.sample_embed)),
                "swiglu_kernel": self.swiglu_kernel is not None,
                "residual_kernel": self.residual_kernel is not None,
                "normed_kernel": self.normed_kernel is not None,
                "attend_kernel": self.attend_kernel is not None,
                "fp8_dense": self.fp8_dense,
                "fp8_rowwise": self.rowwise_plan is not None,
                "fp8_prequant": self.prequant is not None,
                "fp8_glu_quant": self.glu_quant is not None,
                "packed_heads": self.packed_heads,
                "bookkeeping": {f.name: _name(getattr(self.book, f.name))
                                for f in dataclasses.fields(self.book)},
                "codec_kernels": self.codec.fold_bias,
                "codec_conv_plan": self.codec.conv_plan is not None,
                "codec_channels_last": self.codec.channels_last,
                "codec_transformer": getattr(self.codec.rms_norm, "__name__",
                                             str(self.codec.rms_norm))}


def _name(fn: Callable[..., object]) -> str:
    """A function's module-qualified name, for describe()."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', str(fn))}".lstrip(".")


REFERENCE = Ops()
ALL_ROWS = 1 << 30


def _rope_rows(decode_rope: bool | int) -> int:
    if decode_rope is True:
        return ALL_ROWS
    if decode_rope is False:
        return 0
    if not isinstance(decode_rope, int) or decode_rope < 0:
        raise ValueError(f"decode_rope must be a bool or a row count >= 0, got {decode_rope!r}")
    return decode_rope


def build_ops(device: torch.device | str, *, fused: str = "auto", kernels: bool = True,
              sampler_kernel: bool = True, codec_kernels: bool = True,
              split_kv: bool = False, linear_kernels: bool = True,
              fp8_activations: bool = False, codec_channels_last: bool = True,
              decode_rope: bool | int = DECODE_ROPE_ROWS,
              decode_rope_fast: bool | int | None = None, norm_fusion: bool = True,
              pdl: bool | int = False,
              linear_table: Path | None = linear.DEFAULT_TABLE,
              normed_max_m_fp8: int = linear.NORMED_DISPATCH_M_FP8,
              fp8_dense: bool = True, codec_conv_kernel: bool = True,
              codec_conv_table: Path = codec_conv.DEFAULT_TABLE,
              codec_snake_into_next: bool = False, codec_conv_fast_sine: bool = True,
              attend_prologue: bool = False, book_kernels: bool = True,
              attention_triton_rows: int = 0, shared_prefix: bool = False) -> Ops:
    """The ops an engine on `device` runs. `fused`: "compile" (torch.compile'd elementwise ops
    — the model's and the codec transformer's — and the packed FFN GEMM), "reference", or
    "auto" (compile on CUDA only). `kernels`: use
    csrc's kernels where the extension is built, and with compiled ops the Triton q/k norm +
    RoPE kernel (CUDA; False: the torch fallbacks and compiled references everywhere); `sampler_kernel` / `codec_kernels` / `split_kv` select the sampler's draw,
    the codec's Snake/bias kernels and decode attention's split positions among them,
    `decode_rope` up to how many rows decode attention also does the step's q/k norm and
    RoPE (True: every batch, False: none; default `DECODE_ROPE_ROWS`: the c=1 buckets, where it
    saves 76 launches per step; slower at 64 rows on the H200, docs/PERF.md), for the slow AR
    and, unless `decode_rope_fast` says otherwise (None: the same), the fast AR;
    `codec_channels_last`: the streaming codec's convs as NHWC convs over channels-last
    activations (CUDA only: cuDNN's fast kernels are NHWC); `norm_fusion`: where csrc's
    small-M kernel runs a block's projections, the residual add in wo / w2's epilogue and the
    RMSNorm after it in the next projection's prologue (no launch of their own), and with
    `attend_prologue` the fast AR's attention in its output projection's prologue at up to
    `linear.ATTEND_DISPATCH_M` rows (32 launches fewer per frame step, but off: the step is
    slower with it on the H200, docs/PERF.md); `pdl`: csrc's
    linear, attention and sampling kernels launched with programmatic dependent launch (a
    no-op before sm_90; same results), so each one's blocks start while the kernel before it
    ends (an int picks csrc/linear.cu's PDL mode for the linears, for
    benchmarks; True = 1); `normed_max_m_fp8`: the most rows for which FP8 weights take the
    normed prologue (benchmarks: the engine's is `linear.NORMED_DISPATCH_M_FP8`);
    `fp8_dense`: FP8 linears with a dequantised bf16 copy run it at the batch sizes where the
    table measured bf16 faster (CUDA; the engine makes the copies, `fp8_dense_copy`);
    `codec_conv_kernel`: the codec's residual-unit convs as Triton convs with the Snake or
    the residual sum in their epilogues where the recorded table `codec_conv_table` measured
    them faster than cuDNN's conv + csrc's pass (CUDA, channels-last, with csrc's codec
    kernels); `codec_snake_into_next`: with those, a residual unit's fused last conv also
    writes the next conv's Snake'd input (off by default: slower on the H200, docs/PERF.md);
    `codec_conv_fast_sine`: their Snake epilogues with the hardware sine, as csrc's Snake pass
    (on: 0.4 ms faster per 64 x 8 tick on the H200, max abs 0.031 from the accurate sine);
    `book_kernels`: the decode step's draw inputs, frame ids and row updates as csrc's one
    launch each (csrc/bookkeeping.cu; off: the compiled functions, one kernel per output
    size, 12 launches more per frame step); `attention_triton_rows` (> 0): decode attention
    calls of at least that many rows (the slow AR's: the fast AR's 10-position blocks are not
    the Triton kernel's) run engine/kernels/decode_attention_triton.py instead of csrc's
    kernel (0: never); `shared_prefix`: with those, rows that share a voice prompt's KV
    blocks read them once per tile of rows (cascade attention; CUDA with the extension).
    On CUDA the linears (dense and FP8) take the implementation the recorded per-shape table
    `linear_table` picks (csrc's small-M kernel only with `linear_kernels`); FP8 weights
    without a kernel there run the Triton FP8 GEMM (the dequantising reference without it)."""
    if fused not in FUSED_MODES:
        raise ValueError(f"fused ops must be one of {', '.join(FUSED_MODES)}, got {fused!r}")
    if isinstance(attention_triton_rows, bool) or not isinstance(attention_triton_rows, int) \
            or attention_triton_rows < 0:
        raise ValueError(f"attention_triton_rows must be an int >= 0 (0: never), got "
                         f"{attention_triton_rows!r}")
    cuda = torch.device(device).type == "cuda"
    if fused == "auto":
        fused = "compile" if cuda else "reference"
    built = kernels and cuda and extension_available()  # nvcc builds it once, at start-up
    sample, sample_embed = sampling.sample, sampling.sample_embed
    parts: dict[str, object] = {}
    if fused == "compile":
        parts = {name: fusion.compiled(name, getattr(functional, name))
                 for name in ("rms_norm", "add_rms_norm", "norm_rope_qk", "silu_mul",
                              "embed_columns")}
        sample = fusion.compiled("sample", sampling.sample)
        sample_embed = fusion.compiled("sample_embed", sampling.sample_embed)
        parts["book"] = Bookkeeping.built(fusion.compiled)
    if kernels and fused == "compile" and cuda and qk_rope.available():
        # one Triton launch per layer where inductor made up to six
        parts["norm_rope_qk"] = qk_rope.norm_rope_qk
    if built and book_kernels:  # one launch each where inductor made one per output size
        parts["book"] = dataclasses.replace(
            parts.get("book", Bookkeeping()), ras_inputs=step_book.ras_inputs,
            frame_tokens=step_book.frame_tokens, step_end=step_book.step_end)
    pdl = pdl if built else False
    if built and sampler_kernel and fused == "compile":  # the kernel replaces the compiled draw
        sample = (functools.wraps(sampling.sample_topk)(
            functools.partial(sampling.sample_topk, pdl=True)) if pdl else sampling.sample_topk)
        sample_embed = (functools.wraps(sampling.sample_topk_embed)(
            functools.partial(sampling.sample_topk_embed, pdl=True)) if pdl
            else sampling.sample_topk_embed)
    codec = CodecOps(channels_last=cuda and codec_channels_last)
    if built and codec_kernels:
        codec = CodecOps(snake=activation.snake, snake_cat=activation.snake_cat,
                         bias_residual=activation.bias_residual, fold_bias=True,
                         channels_last=codec.channels_last)
    if (built and codec_kernels and codec.channels_last and codec_conv_kernel
            and codec_conv.available()):
        codec = dataclasses.replace(codec, conv_plan=codec_conv.load_plan(codec_conv_table),
                                    snake_into_next=codec_snake_into_next,
                                    conv_fast_sine=codec_conv_fast_sine)
    if fused == "compile":  # the codec transformer's pointwise ops and the convs' tail cuts,
        # with compiled graphs and recompile budgets of their own (the codec's shapes and
        # dtypes would spend the model's: dynamo keys both on the function's code)
        ref = CodecOps(lookup_sum=lookup_sum)
        codec = dataclasses.replace(codec, packed_ffn=True, **{
            name: fusion.compiled(f"codec_{name}", getattr(ref, name), own_cache=True)
            for name in ("rms_norm", "norm_rope_qk", "silu_mul", "add_scaled", "ring_window",
                         "take_last", "lookup_sum")})
    if cuda:
        plan = linear.load_plan(linear_table)
        parts["dense_plan"] = plan if fp8_dense else None
        parts["rowwise_plan"] = plan if fp8_activations else None
        # the rowwise W8A8 GEMM's per-row activation quantisation: one launch compiled
        quantize = (fusion.compiled("quantize_rows", quant.quantize_rows)
                    if fp8_activations and fused == "compile" else quant.quantize_rows)
        parts["linear"] = linear.make_linear(plan, kernels=built and linear_kernels,
                                             fp8_activations=fp8_activations, pdl=pdl,
                                             dense=fp8_dense, quantize=quantize)
        if fused == "compile" and built and linear_kernels:  # with the packed FFN only
            w8a8 = {"pdl": pdl, "dense": fp8_dense, "fp8_activations": fp8_activations}
            parts["swiglu_kernel"] = linear.make_swiglu(plan, kernels=True, **w8a8)
            if norm_fusion:
                parts["residual_kernel"] = linear.make_residual(plan, kernels=True, **w8a8)
                if fp8_activations:  # the norms and gates quantise for the W8A8 GEMMs
                    parts["prequant"] = linear.make_prequant(plan, True, dense=fp8_dense)
                    parts["glu_quant"] = linear.make_glu(plan, True, dense=fp8_dense)
                parts["normed_kernel"] = linear.make_normed(
                    plan, kernels=True, max_m_fp8=normed_max_m_fp8, **w8a8)
                if attend_prologue:
                    parts["attend_kernel"] = linear.make_attend(plan, kernels=True, **w8a8)
    return Ops(
        fused=fused, packed_ffn=fused == "compile", packed_heads=fused == "compile",
        sample=sample, sample_embed=sample_embed, codec=codec,
        decode_attention=(functools.partial(decode_attention, splits=0 if split_kv else 1,
                                            pdl=bool(pdl), triton_rows=attention_triton_rows)
                          if built else None),
        decode_rope=_rope_rows(decode_rope) if built else 0,
        shared_prefix=bool(shared_prefix and attention_triton_rows and built),
        decode_rope_fast=(_rope_rows(decode_rope if decode_rope_fast is None
                                     else decode_rope_fast) if built else 0),
        pdl=bool(pdl),
        shift_window=functools.partial(prev_tokens_shift_inplace, kernel=built),
        **parts,  # type: ignore[arg-type]
    )
