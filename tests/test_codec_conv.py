"""engine/kernels/codec_conv.py: the contract, the formulas against torch's conv and the
codec's Snake / residual sum, the residual unit streamed through `CodecOps.conv` against the
offline layers, and (with TRITON_INTERPRET=1 on the CPU, or on CUDA) the Triton kernel
against a float64 reference.

Tolerance of the kernel: it multiplies bf16 operands exactly, accumulates in float32 and
rounds once, so against float64 each output may be off by bf16's rounding (2^-8 relative)
plus the accumulation error (1e-5 of sum |x w| bounds it here); the Snake's sine is float32.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from _codec_stream import CUTS, stream_vs_offline, unit_block

from engine.codec.layers import (
    CodecOps,
)
from engine.kernels import codec_conv as cc
from engine.kernels.fp8_triton import _triton_importable

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and _triton_importable()
CUDA = cc.available()
needs_interp = pytest.mark.skipif(not INTERPRET,
                                  reason="needs TRITON_INTERPRET=1 and triton importable")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")


def _operands(B, C, N, T, k, d, device="cpu", dtype=torch.bfloat16, seed=0):  # type: ignore[no-untyped-def]
    """x [B, C, P + T] channels-last with streams further apart than P + T (a slice), weight
    [N, C, k], bias, alpha, residual [B, N, T] channels-last (a slice of a wider buffer)."""
    g = torch.Generator().manual_seed(seed)
    P = (k - 1) * d
    x = torch.randn(B, P + T + 3, C, generator=g)[:, :P + T].transpose(1, 2)
    w = torch.randn(N, C, k, generator=g) / (C * k) ** 0.5
    bias = torch.randn(N, generator=g) * 0.1
    alpha = torch.rand(N, generator=g) + 0.3
    res = torch.randn(B, T + 2, N, generator=g)[:, 1:T + 1].transpose(1, 2)
    return [t.to(device=device, dtype=dtype) for t in (x, w, bias, alpha, res)]


def _reference(x, w, bias, d, alpha=None, residual=None):  # type: ignore[no-untyped-def]
    """float64: conv + bias, then Snake or the residual sum; and sum |x w| per output."""
    xd, wd, bd = x.double(), w.double(), bias.double().reshape(1, -1, 1)
    y = torch.nn.functional.conv1d(xd, wd, None, dilation=d) + bd
    mag = torch.nn.functional.conv1d(xd.abs(), wd.abs(), None, dilation=d)
    if alpha is not None:
        a = alpha.double().reshape(1, -1, 1)
        y = y + torch.sin(a * y) ** 2 / (a + 1e-9)
    elif residual is not None:
        y = residual.double() + y
    return y, mag


def _assert_kernel_close(got, x, w, bias, d, alpha=None, residual=None):  # type: ignore[no-untyped-def]
    ref, mag = _reference(x, w, bias, d, alpha, residual)
    assert got.shape == ref.shape
    # channels-last, dense: [B, T, N] in memory
    assert got.transpose(1, 2).is_contiguous()
    err = (got.double() - ref).abs()
    # Snake's derivative is at most 1 + |alpha|-ish: scale the accumulation bound by 3
    bound = 2 ** -8 * ref.abs() + 3e-5 * (mag + 1) + 1e-6
    worst = float((err - bound).max())
    assert worst <= 0, f"kernel vs float64: exceeds the bound by {worst:.3g} " \
                       f"(max err {float(err.max()):.3g})"


CASES = [  # B, C, N, T, k, d, epilogue
    (2, 32, 48, 5, 7, 3, "snake"), (3, 64, 64, 9, 1, 1, "residual"),
    (1, 16, 130, 4, 7, 1, "none"), (2, 96, 96, 37, 7, 9, "snake"), (5, 48, 200, 3, 1, 1,
                                                                  "residual")]


def _epilogue(kind, alpha, res):  # type: ignore[no-untyped-def]
    return {"snake": {"alpha": alpha}, "residual": {"residual": res}, "none": {}}[kind]


# ------------------------------------------------------------------------- the formulas
@pytest.mark.parametrize("B,C,N,T,k,d,kind", CASES)
def test_formulas_are_the_unfused_ops(B, C, N, T, k, d, kind):
    """On the CPU `causal_conv` runs the formulas: torch's conv rounded, then the codec's
    Snake (bias folded in) or x + (y + bias), exactly as the unfused residual unit does."""
    x, w, bias, alpha, res = _operands(B, C, N, T, k, d, dtype=torch.float32)
    got = cc.causal_conv(x, w, bias, d, **_epilogue(kind, alpha, res))
    y = torch.nn.functional.conv1d(x, w, None, dilation=d)
    want = {"snake": lambda: (y + bias.view(1, -1, 1)) + torch.sin(
                alpha.view(1, -1, 1) * (y + bias.view(1, -1, 1))) ** 2
                * (alpha.view(1, -1, 1) + 1e-9).reciprocal(),
            "residual": lambda: res + (y + bias.view(1, -1, 1)),
            "none": lambda: y + bias.view(1, -1, 1)}[kind]()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_the_problem():
    x, w, bias, alpha, res = _operands(2, 16, 8, 5, 7, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        cc.causal_conv(x, w[:, :8], bias, 1)
    with pytest.raises(ValueError, match="dilation"):
        cc.causal_conv(x, w, bias, 0)
    with pytest.raises(ValueError, match="fewer than the conv's span"):
        cc.causal_conv(x, w, bias, 9)
    with pytest.raises(ValueError, match="not both"):
        cc.causal_conv(x, w, bias, 1, alpha=alpha, residual=res)
    with pytest.raises(ValueError, match="bias has 7 values for 8 channels"):
        cc.causal_conv(x, w, bias[:7], 1)
    buf = torch.empty(2, 8, 11)
    with pytest.raises(ValueError, match="residual sum only"):
        cc.causal_conv(x, w, bias, 1, next_input=(buf, alpha))
    with pytest.raises(ValueError, match="next_input buffer"):
        cc.causal_conv(x, w, bias, 1, residual=res, next_input=(buf[..., :3], alpha))
    with pytest.raises(ValueError, match="next_input's alpha"):
        cc.causal_conv(x, w, bias, 1, residual=res, next_input=(buf, alpha[:3]))
    with pytest.raises(TypeError, match="next_input buffer"):
        cc.causal_conv(x, w, bias, 1, residual=res, next_input=(buf.double(), alpha))
    with pytest.raises(ValueError, match="residual"):
        cc.causal_conv(x, w, bias, 1, residual=res[:, :, :3])
    with pytest.raises(TypeError, match="alpha"):
        cc.causal_conv(x, w, bias, 1, alpha=alpha.double())
    with pytest.raises(ValueError, match="power of two"):
        cc.Config(block_m=96).check()
    with pytest.raises(ValueError, match="at most 128"):
        cc.Config(block_n=256).check()
    with pytest.raises(ValueError, match="conv1d weight"):
        cc.conv_taps(w[0])


def test_taps_layout():
    """conv_taps: row j * C + c holds weight[:, c, j], the output channels padded with
    zeros to a multiple of 128."""
    w = torch.randn(130, 16, 7)
    taps = cc.conv_taps(w)
    assert taps.shape == (7 * 16, 256) and taps.is_contiguous()
    assert torch.equal(taps[3 * 16 + 5, :130], w[:, 5, 3])
    assert not taps[:, 130:].any()


def test_config_rule_fits_the_codec():
    """The launch rule's reduction step divides every S2-Pro residual unit's channels."""
    for c in (96, 192, 384, 768):
        for m in (32, 4096, 131072):
            cfg = cc.config_for(m, c, c)
            cfg.check()
            assert c % cfg.block_k == 0


# ------------------------------------------------------------------------- the plan
def test_plan_chooses_by_measurement(tmp_path):
    """load_plan: the fused conv where its best shape beat cuDNN + its pass by the margin,
    the nearest measured row count of the conv's (c, k, d), cuDNN for anything unmeasured;
    a bad table is a ValueError naming the file and the command that writes one."""
    rows = [{"streams": s, "samples": 100, "channels": 96, "k": 7, "dilation": 9,
             "cudnn_ms": 1.0, "best_ms": best, "best_config": [128, 64, 32, 4, 3]}
            for s, best in ((64, 0.5), (1, 0.99))]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"convs": rows}))
    plan = cc.load_plan(path)
    assert plan.choose(96, 7, 9, 64 * 100) == cc.Config(128, 64, 32, 4, 3)
    assert plan.choose(96, 7, 9, 3000) == cc.Config(128, 64, 32, 4, 3)  # nearer 6,400
    assert plan.choose(96, 7, 9, 150) is None  # nearer 100: 0.99 is within the margin
    assert plan.choose(96, 7, 9, 40) is None  # under half the fewest rows measured
    assert plan.choose(96, 7, 3, 6400) is None and plan.choose(192, 7, 9, 6400) is None
    path.write_text("{}")
    with pytest.raises(ValueError, match="codec_conv_bench"):
        cc.load_plan(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="codec_conv_bench"):
        cc.load_plan(path)
    # the committed table loads and picks some convs on the GPU it was recorded on
    committed = cc.load_plan(device="NVIDIA H200")
    assert any(cfg is not None for *_, cfg in committed.rows)
    assert cc.load_plan(device=None) == committed  # no GPU to compare: as recorded


def test_a_table_from_another_gpu_is_ignored(tmp_path, caplog):
    """A table records the GPU it was measured on: on another, the plan is empty (cuDNN
    everywhere) and a warning names both GPUs and the command that records a table."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "convs": [
        {"streams": 1, "samples": 64, "channels": 96, "k": 1, "dilation": 1, "cudnn_ms": 1.0,
         "best_ms": 0.5, "best_config": [64, 64, 32, 4, 3]}]}))
    assert cc.load_plan(path, device="NVIDIA H200").rows
    with caplog.at_level("WARNING"):
        assert cc.load_plan(path, device="NVIDIA A100-SXM4-80GB") == cc.Plan()
    assert "NVIDIA A100" in caplog.text and "codec_conv_bench --sweep" in caplog.text


# ------------------------------------------------------------------------- the residual unit
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("fuse", ["both", "conv7", "none"])
def test_residual_unit_streams_through_the_plan(monkeypatch, channels_last, fuse):
    """A residual unit streamed in uneven chunks with `CodecOps.conv_plan` gives the offline
    unit, whichever convs the plan fuses: those go through `causal_conv` (its formulas on the
    CPU: the call path the kernel takes on a GPU), the others through the conv and the
    pointwise op."""
    import engine.codec.layers as layers

    calls = []
    sines = []

    def conv(*a, **k):  # type: ignore[no-untyped-def]
        calls.append("alpha" if k.get("alpha") is not None else "residual")
        sines.append(k.get("fast_sine"))
        return cc.causal_conv(*a, **k)

    monkeypatch.setattr(layers, "causal_conv", conv)
    cfg = cc.Config(64, 64, 16)
    plan = cc.Plan(((16, 7, 3, 1, cfg if fuse != "none" else None),
                    (16, 1, 1, 1, cfg if fuse == "both" else None)))
    block = unit_block(16)
    x = torch.randn(2, 16, 50)
    for fast in (False, True):  # the sine choice reaches the kernel (the CPU's formulas: same)
        calls.clear()
        sines.clear()
        ops = CodecOps(conv_plan=plan, channels_last=channels_last, conv_fast_sine=fast)
        got, want = stream_vs_offline(block, x, ops, channels_last)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert calls == {"both": ["alpha", "residual"], "conv7": ["alpha"],
                         "none": []}[fuse] * 4
        assert sines == [fast] * len(calls)


# ------------------------------------------------------------------------- the kernel
@needs_interp
@pytest.mark.parametrize("B,C,N,T,k,d,kind", CASES)
def test_interp_kernel_matches_reference(monkeypatch, B, C, N, T, k, d, kind):
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    x, w, bias, alpha, res = _operands(B, C, N, T, k, d)
    ep = _epilogue(kind, alpha, res)
    for cfg in (cc.Config(16, 32, 16, 4, 1), cc.Config(32, 64, 16, 4, 1)):
        got = cc._launch(x, w, bias, d, ep.get("alpha"), ep.get("residual"), None, cfg,
                         x.shape[2] - (k - 1) * d)
        _assert_kernel_close(got, x, w, bias, d, **ep)


@needs_cuda
@pytest.mark.parametrize("B,C,N,T,k,d,kind", [
    *CASES, (64, 384, 384, 64, 7, 9, "snake"), (64, 96, 96, 512, 1, 1, "residual"),
    (3, 768, 768, 8, 7, 3, "snake"), (1, 192, 192, 1, 7, 1, "snake")])
def test_cuda_kernel_matches_reference(B, C, N, T, k, d, kind):
    x, w, bias, alpha, res = _operands(B, C, N, T, k, d, device="cuda")
    ep = _epilogue(kind, alpha, res)
    assert cc.supported(x, w, ep.get("residual"))
    _assert_kernel_close(cc.causal_conv(x, w, bias, d, **ep), x, w, bias, d, **ep)
    for cfg in (cc.Config(64, 64, 16, 4, 2), cc.Config(128, 128, 16, 8, 3)):
        _assert_kernel_close(cc.causal_conv(x, w, bias, d, config=cfg, **ep), x, w, bias, d,
                             **ep)


def _next_input_case(B, C, N, T, k, d, device, config=None, launch=False,  # type: ignore[no-untyped-def]
                     dtype=torch.bfloat16):
    """The residual epilogue with the next Snake into a [tail | new] buffer (P2 = 5 tail
    rows holding a sentinel): the output as the residual epilogue's, the buffer's new rows
    the Snake of the output's rounded values (as the unfused snake_cat computes it from the
    stored output), its tail untouched."""
    from engine.kernels.activation import snake_torch

    x, w, bias, _, res = _operands(B, C, N, T, k, d, device=device, dtype=dtype)
    alpha2 = (torch.rand(N, generator=torch.Generator().manual_seed(1)) + 0.3).to(x)
    buf = torch.full((B, 5 + T, N), 7.0, dtype=x.dtype, device=device).transpose(1, 2)
    if launch:
        y = cc._launch(x, w, bias, d, None, res, None, config, T, (buf, alpha2))
    else:
        y = cc.causal_conv(x, w, bias, d, residual=res, next_input=(buf, alpha2), config=config)
    _assert_kernel_close(y, x, w, bias, d, residual=res)
    assert bool((buf[..., :5] == 7.0).all())
    want = snake_torch(y.float(), alpha2.float()).to(y.dtype)
    torch.testing.assert_close(buf[..., 5:].float(), want.float(), rtol=2 ** -7, atol=1e-5)


def test_formulas_write_the_next_input():
    _next_input_case(2, 32, 48, 6, 1, 1, "cpu", dtype=torch.float32)


@needs_interp
@pytest.mark.parametrize("B,C,N,T,k,d", [(2, 32, 48, 6, 1, 1), (3, 16, 130, 4, 7, 3)])
def test_interp_kernel_writes_the_next_input(monkeypatch, B, C, N, T, k, d):
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    _next_input_case(B, C, N, T, k, d, "cpu", cc.Config(16, 32, 16, 4, 1), launch=True)


@needs_cuda
@pytest.mark.parametrize("B,C,N,T,k,d", [(2, 32, 48, 5, 7, 3), (64, 384, 384, 64, 7, 9),
                                         (3, 768, 768, 8, 7, 3)])
def test_cuda_kernel_with_the_hardware_sine(B, C, N, T, k, d):
    """`fast_sine`: the Snake epilogue with the hardware sine stays within the kernel's bound
    against float64 (its error is far below bf16's rounding), and so does the next-input
    epilogue."""
    x, w, bias, alpha, _ = _operands(B, C, N, T, k, d, device="cuda")
    # arguments alpha * y up to ~|10|: the hardware sine's error grows slowly with them
    got = cc.causal_conv(x, w, bias * 30, d, alpha=alpha, fast_sine=True)
    _assert_kernel_close(got, x, w, bias * 30, d, alpha=alpha)
    accurate = cc.causal_conv(x, w, bias * 30, d, alpha=alpha)
    # at most one bf16 rounding step apart from the accurate sine's result
    diff = (got.float() - accurate.float()).abs()
    assert bool((diff <= 2 ** -7 * accurate.float().abs() + 1e-3).all()), float(diff.max())


@needs_cuda
@pytest.mark.parametrize("B,C,N,T,k,d", [(2, 32, 48, 6, 1, 1), (64, 96, 96, 512, 1, 1),
                                         (5, 48, 200, 3, 1, 1), (3, 16, 130, 4, 7, 3)])
def test_cuda_kernel_writes_the_next_input(B, C, N, T, k, d):
    for cfg in (None, cc.Config(64, 64, 16, 4, 2), cc.Config(128, 128, 16, 8, 3)):
        _next_input_case(B, C, N, T, k, d, "cuda", cfg)


@pytest.mark.parametrize("fuse", ["all", "conv7"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_residual_units_write_the_next_convs_input(monkeypatch, fuse, channels_last):
    """Two residual units, a Snake and a conv streamed in uneven chunks: with
    `snake_into_next`, where a unit's last conv runs fused it writes the next module's [tail | Snake] input (the next unit's first
    conv, then the output conv), which takes it as it is — the offline output either way."""
    import engine.codec.layers as layers
    from engine.codec.layers import CausalConv1d, ResidualUnit, Snake1d

    nexts = []

    def conv(*a, **k):  # type: ignore[no-untyped-def]
        nexts.append(k.get("next_input") is not None)
        return cc.causal_conv(*a, **k)

    monkeypatch.setattr(layers, "causal_conv", conv)
    torch.manual_seed(0)
    block = torch.nn.Sequential(ResidualUnit(16, dilation=3), ResidualUnit(16, dilation=1),
                                Snake1d(16), CausalConv1d(16, 4, kernel_size=7)).eval()
    for m in block.modules():
        if isinstance(m, Snake1d):
            m.alpha.data = torch.rand_like(m.alpha) + 0.3
    cfg = cc.Config(64, 64, 16)
    k1 = cfg if fuse == "all" else None
    plan = cc.Plan(((16, 7, 3, 1, cfg), (16, 7, 1, 1, cfg), (16, 1, 1, 1, k1)))
    x = torch.randn(2, 16, 50)
    ops = CodecOps(conv_plan=plan, channels_last=channels_last, snake_into_next=True)
    got, want = stream_vs_offline(block, x, ops, channels_last)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    per_chunk = [False, True, False, True] if fuse == "all" else [False, False]
    assert nexts == per_chunk * 4
    nexts.clear()  # off (the default): every conv makes its own input
    off = CodecOps(conv_plan=plan, channels_last=channels_last)
    got, _ = stream_vs_offline(block, x, off, channels_last)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not any(nexts) and len(nexts) == len(per_chunk) * 4


@needs_cuda
def test_cuda_codec_with_the_fused_convs():
    """The S2-Pro codec streamed in bf16 through CUDA graphs with every residual-unit conv
    fused, against the float32 offline decode: no further from it than the cuDNN path is."""
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec
    from engine.ops import build_ops

    # every residual-unit conv fused (the committed plan fuses some), against cuDNN
    every = cc.Plan(tuple((c, k, d, 1, cc.config_for(4096, c, c)) for c in (96, 192, 384, 768)
                          for k, d in ((7, 1), (7, 3), (7, 9), (1, 1))))
    fused = dataclasses.replace(build_ops("cuda").codec, conv_plan=every)
    plain = build_ops("cuda", codec_conv_kernel=False).codec
    assert plain.conv_plan is None and plain.fold_bias, "the CUDA extension did not build"
    codes = torch.randint(0, 1024, (1, 10, 12), generator=torch.Generator().manual_seed(3))
    ref_codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device="cuda",
                            dtype=torch.float32)
    with torch.inference_mode():
        want = ref_codec.decode(codes.cuda())[0, 0].cpu()
    del ref_codec
    codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device="cuda",
                        dtype=torch.bfloat16)
    errs = {}
    for name, ops in (("fused", fused), ("cudnn", plain)):
        dec = StreamingDecoder(codec, max_streams=2, buckets=True, max_frames=64, ops=ops)
        dec.capture(keys=[(1, 1), (1, 4), (1, 8)])
        sid = dec.open()
        with torch.inference_mode():
            got = torch.cat([dec.decode({sid: codes[0, :, a:b]})[sid].float().cpu()
                             for a, b in ((0, 1), (1, 5), (5, 12))])
        assert got.shape == want.shape
        errs[name] = float((got - want).norm() / want.norm())
    assert errs["fused"] <= 1.1 * errs["cudnn"] + 1e-3, errs


# ------------------------------------------------------------------------- the fused unit
def _unit_operands(B, C, T, d, device="cpu", dtype=torch.bfloat16, seed=0):  # type: ignore[no-untyped-def]
    """A residual unit's operands after its first Snake: x [B, C, T] (the residual) and xx
    [B, C, P + T] (the k=7 conv's [tail | Snake(x)] input), both channels-last slices; w7,
    b7, alpha2, w1, b1."""
    xx, w7, b7, alpha2, x = _operands(B, C, C, T, 7, d, device, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w1 = (torch.randn(C, C, 1, generator=g) / C ** 0.5).to(device=device, dtype=dtype)
    b1 = (torch.randn(C, generator=g) * 0.1).to(device=device, dtype=dtype)
    return x, xx, w7, b7, alpha2, w1, b1


def _assert_unit_close(got, x, xx, w7, b7, d, alpha2, w1, b1):  # type: ignore[no-untyped-def]
    """Against float64 with the unit's middle activation rounded to x's dtype (as the kernel
    and the two-launch path store it): that rounding may land an ulp apart, so the bound
    adds 2^-7 of sum |h w1| to the output's own rounding and float32 accumulation."""
    h, _ = _reference(xx, w7, b7, d, alpha=alpha2)
    h = h.to(x.dtype).double()
    w1d = w1.double()
    ref = x.double() + torch.nn.functional.conv1d(h, w1d) + b1.double().reshape(1, -1, 1)
    mag = torch.nn.functional.conv1d(h.abs(), w1d.abs())
    assert got.shape == ref.shape and got.transpose(1, 2).is_contiguous()
    err = (got.double() - ref).abs()
    bound = 2 ** -8 * ref.abs() + 2 ** -7 * mag + 3e-5 * (mag + 1) + 1e-6
    worst = float((err - bound).max())
    assert worst <= 0, f"fused unit vs float64: exceeds the bound by {worst:.3g} " \
                       f"(max err {float(err.max()):.3g})"


UNIT_CASES = [(2, 32, 5, 3), (3, 16, 9, 1), (1, 96, 37, 9), (2, 48, 4, 1)]  # B, C, T, d


def test_unit_formulas_are_the_offline_unit():
    """residual_unit's formulas (what a CPU runs) against the offline ResidualUnit on the
    same samples: its [tail | Snake(x)] input made from zeros as the offline unit pads."""
    from engine.codec.layers import ResidualUnit

    torch.manual_seed(0)
    unit = ResidualUnit(16, dilation=3).eval()
    for m in unit.modules():
        if hasattr(m, "alpha"):
            m.alpha.data = torch.rand_like(m.alpha) + 0.3
    x = torch.randn(2, 16, 30)
    act1, conv7, act2, conv1 = unit.block
    xx = torch.cat([torch.zeros(2, 16, 18), act1(x)], dim=-1)
    with torch.no_grad():
        got = cc.residual_unit(x, xx, conv7.conv.weight, conv7.conv.bias, 3, act2.alpha,
                               conv1.conv.weight, conv1.conv.bias)
        torch.testing.assert_close(got, unit(x), rtol=1e-5, atol=1e-5)


def test_unit_bad_arguments_name_the_problem():
    x, xx, w7, b7, a2, w1, b1 = _unit_operands(2, 16, 5, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"w1 \[16, 8, 1\] \[16, 16, 1\]"):
        cc.residual_unit(x, xx, w7, b7, 3, a2, w1[:, :8], b1)
    with pytest.raises(ValueError, match="gives 5 outputs for 2 streams; x"):
        cc.residual_unit(x[..., :4], xx, w7, b7, 3, a2, w1, b1)
    with pytest.raises(ValueError, match="b1 has 3 values"):
        cc.residual_unit(x, xx, w7, b7, 3, a2, w1, b1[:3])
    with pytest.raises(ValueError, match="alpha has 3 values"):
        cc.residual_unit(x, xx, w7, b7, 3, a2[:3], w1, b1)
    with pytest.raises(TypeError, match="w1"):
        cc.residual_unit(x, xx, w7, b7, 3, a2, w1.double(), b1)
    with pytest.raises(ValueError, match="fewer than the conv's span"):
        cc.residual_unit(x, xx[..., :10], w7, b7, 3, a2, w1, b1)


def test_unit_config_rule_fits_the_codec():
    """The unit's launch rule: its reduction step divides C, its output chunk fits the padded
    channels, for the S2-Pro units it may take (96, 192) and the fixture's."""
    for c in (16, 32, 48, 96, 192, 256):
        for m in (8, 4096, 131072):
            cfg = cc.unit_config_for(m, c)
            cfg.check()
            assert c % cfg.block_k == 0 and cfg.block_n <= cc._pow2(c)


def test_plan_loads_the_fused_units(tmp_path):
    """A table's "units" rows: the fused unit where it beat the unit's two convs by the
    margin, at the nearest measured rows; a table without them (recorded before) has none."""
    unit = {"channels": 96, "dilation": 9, "samples": 100, "best_config": [64, 64, 32, 4, 3]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"convs": [], "units": [
        {**unit, "streams": 64, "two_convs_ms": 1.0, "best_ms": 0.8},
        {**unit, "streams": 1, "two_convs_ms": 1.0, "best_ms": 0.99}]}))
    plan = cc.load_plan(path)
    assert plan.choose_unit(96, 9, 6400) == cc.Config(64, 64, 32, 4, 3)
    assert plan.choose_unit(96, 9, 100) is None  # within the margin
    assert plan.choose_unit(96, 3, 6400) is None and plan.choose(96, 0, 9, 6400) is None
    path.write_text(json.dumps({"convs": []}))
    assert cc.load_plan(path).units == ()


@pytest.mark.parametrize("channels_last", [False, True])
def test_residual_unit_streams_as_one_launch_through_the_plan(monkeypatch, channels_last):
    """With a plan row for the fused unit, each chunk of a streamed unit is one
    `residual_unit` call (its formulas on the CPU: the kernel's call path) and the stream
    still gives the offline unit; the next conv makes its own input (no `then`)."""
    import engine.codec.layers as layers

    calls = []

    def unit(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(k.get("config"))
        return cc.residual_unit(*a, **k)

    monkeypatch.setattr(layers, "residual_unit", unit)
    cfg = cc.Config(64, 16, 16)
    plan = cc.Plan((), ((16, 0, 3, 1, cfg),))
    got, want = stream_vs_offline(unit_block(16), torch.randn(2, 16, 50),
                                  CodecOps(conv_plan=plan, channels_last=channels_last,
                                           snake_into_next=True), channels_last)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [cfg] * 4


@needs_interp
@pytest.mark.parametrize("B,C,T,d", UNIT_CASES)
def test_interp_unit_kernel_matches_reference(monkeypatch, B, C, T, d):
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    ops = _unit_operands(B, C, T, d)
    for cfg in (cc.Config(16, 16, 16, 4, 1), cc.Config(32, min(64, cc._pow2(C)), 16, 4, 1)):
        got = cc._unit_launch(*ops[:4], d, *ops[4:], None, None, cfg, T)
        _assert_unit_close(got, *ops[:4], d, *ops[4:])


@needs_cuda
@pytest.mark.parametrize("B,C,T,d", [*UNIT_CASES, (64, 96, 512, 9), (64, 192, 128, 1),
                                     (1, 192, 2, 3)])
@pytest.mark.parametrize("fast_sine", [False, True])
def test_cuda_unit_kernel_matches_reference(B, C, T, d, fast_sine):
    x, xx, w7, b7, a2, w1, b1 = _unit_operands(B, C, T, d, device="cuda")
    assert cc.unit_supported(x, xx)
    _assert_unit_close(cc.residual_unit(x, xx, w7, b7, d, a2, w1, b1, fast_sine=fast_sine),
                       x, xx, w7, b7, d, a2, w1, b1)
    for cfg in (cc.Config(32, 16, 16, 4, 2),
                cc.Config(128, min(64, cc._pow2(C)), 32 if C % 32 == 0 else 16, 8, 3)):
        got = cc.residual_unit(x, xx, w7, b7, d, a2, w1, b1, config=cfg, fast_sine=fast_sine)
        _assert_unit_close(got, x, xx, w7, b7, d, a2, w1, b1)


# ------------------------------------------------------------------------- the transposed convs
UP_CASES = [(16, 8, 4, 2), (8, 4, 16, 8), (16, 6, 5, 2), (16, 2, 3, 3)]  # C_in, C_out, k, s


def _up_operands(B, cin, cout, k, s, T, device="cpu", dtype=torch.float32, seed=0):  # type: ignore[no-untyped-def]
    """x [B, C_in, T] channels-last, the transposed conv's weight [C_in, C_out, k] and bias,
    and xx = [m - 1 zero rows | x] (a stream's first input: its history is zeros)."""
    g = torch.Generator().manual_seed(seed)
    m = -(-k // s)
    x = torch.randn(B, T, cin, generator=g).transpose(1, 2)
    w = torch.randn(cin, cout, k, generator=g) / (cin * m) ** 0.5
    b = torch.randn(cout, generator=g) * 0.1
    xx = torch.cat([torch.zeros(B, m - 1, cin), x.transpose(1, 2)], dim=1).transpose(1, 2)
    return [t.to(device=device, dtype=dtype) for t in (x, w, b, xx)]


@pytest.mark.parametrize("cin,cout,k,s", UP_CASES)
def test_upsample_is_the_transposed_conv(cin, cout, k, s):
    """`upsample` over [history | x] with `transposed_weight` and the bias repeated gives the
    causal transposed conv's outputs (its first T * s), channels-last."""
    x, w, b, xx = _up_operands(2, cin, cout, k, s, 7)
    got = cc.upsample(xx, w, b, s)
    want = torch.nn.functional.conv_transpose1d(x, w, b, stride=s)[..., :7 * s]
    assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int stride"):
        cc.transposed_weight(w, 0)
    with pytest.raises(ValueError, match="upsample: a ConvTranspose1d weight"):
        cc.upsample(xx, w, b.repeat(s), s)  # a bias per output channel of the conv's


def test_plan_loads_the_transposed_convs(tmp_path):
    up = {"channels": 192, "k": 4, "stride": 2, "samples": 100, "best_config": [64, 64, 64, 4, 3]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"convs": [], "ups": [
        {**up, "streams": 64, "cudnn_ms": 1.0, "best_ms": 0.5},
        {**up, "streams": 1, "cudnn_ms": 1.0, "best_ms": 1.2}]}))
    plan = cc.load_plan(path)
    assert plan.choose_up(192, 4, 2, 6400) == cc.Config(64, 64, 64, 4, 3)
    assert plan.choose_up(192, 4, 2, 100) is None and plan.choose_up(192, 8, 4, 6400) is None
    path.write_text(json.dumps({"convs": []}))
    assert cc.load_plan(path).ups == ()


@pytest.mark.parametrize("channels_last", [False, True])
def test_transposed_conv_streams_as_a_conv_through_the_plan(monkeypatch, channels_last):
    """A Snake + causal transposed conv streamed in uneven chunks with a plan row for it: one
    `upsample` call per chunk (its formulas on the CPU) and the offline output."""
    import engine.codec.layers as layers
    from engine.codec.layers import CausalConvTranspose1d, Snake1d

    calls = []

    def up(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(k.get("config"))
        return cc.upsample(*a, **k)

    monkeypatch.setattr(layers, "upsample", up)
    torch.manual_seed(0)
    block = torch.nn.Sequential(Snake1d(16), CausalConvTranspose1d(16, 8, 4, 2)).eval()
    block[0].alpha.data = torch.rand_like(block[0].alpha) + 0.3
    cfg = cc.Config(64, 64, 16)
    plan = cc.Plan((), (), ((16, 4, 2, 1, cfg),))
    got, want = stream_vs_offline(block, torch.randn(2, 16, 50),
                                  CodecOps(conv_plan=plan, channels_last=channels_last),
                                  channels_last)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [cfg] * 4


def _assert_up_close(got, x, w, b, s, T):  # type: ignore[no-untyped-def]
    xd, wd = x.double(), w.double()
    ref = torch.nn.functional.conv_transpose1d(xd, wd, b.double(), stride=s)[..., :T * s]
    mag = torch.nn.functional.conv_transpose1d(xd.abs(), wd.abs(), stride=s)[..., :T * s]
    assert got.shape == ref.shape and got.transpose(1, 2).is_contiguous()
    err = (got.double() - ref).abs()
    worst = float((err - (2 ** -8 * ref.abs() + 3e-5 * (mag + 1) + 1e-6)).max())
    assert worst <= 0, f"upsample vs float64: exceeds the bound by {worst:.3g}"


@needs_interp
@pytest.mark.parametrize("cin,cout,k,s", [(16, 8, 4, 2), (32, 16, 16, 8), (16, 6, 5, 2)])
def test_interp_upsample_kernel_matches_reference(monkeypatch, cin, cout, k, s):
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    x, w, b, xx = _up_operands(3, cin, cout, k, s, 9, dtype=torch.bfloat16)
    we, be = cc.transposed_weight(w, s), b.repeat(s)
    y = cc._launch(xx, we, be, 1, None, None, None, cc.Config(16, 32, 16, 4, 1), 9)
    _assert_up_close(y.transpose(1, 2).reshape(3, 9 * s, cout).transpose(1, 2), x, w, b, s, 9)
    # upsample's kernel branch (the weight only a stride-0 shape, the taps made or given)
    monkeypatch.setattr(cc, "available", lambda: True)
    monkeypatch.setattr(cc, "supported", lambda x, w, *a, **k: x.stride(1) == 1)
    taps = cc.conv_taps(we)
    for t in (None, taps):
        got = cc.upsample(xx, w, b, s, taps=t, config=cc.Config(16, 32, 16, 4, 1))
        _assert_up_close(got, x, w, b, s, 9)


@needs_cuda
@pytest.mark.parametrize("cin,cout,k,s,T", [(16, 8, 4, 2, 9), (192, 96, 4, 2, 300),
                                            (384, 192, 8, 4, 64), (1536, 768, 16, 8, 8)])
def test_cuda_upsample_matches_reference(cin, cout, k, s, T):
    x, w, b, xx = _up_operands(4, cin, cout, k, s, T, device="cuda", dtype=torch.bfloat16)
    assert cc.supported(xx, w)
    taps = cc.conv_taps(cc.transposed_weight(w, s))
    for cfg in (None, cc.Config(64, 64, 16, 4, 2), cc.Config(128, 128, min(64, cin), 8, 3)):
        _assert_up_close(cc.upsample(xx, w, b, s, config=cfg), x, w, b, s, T)
        _assert_up_close(cc.upsample(xx, w, b, s, config=cfg, taps=taps), x, w, b, s, T)


def test_bench_rows_run_on_the_cpu():
    """codec_conv_bench's row functions (the conv, the fused unit, the transposed conv) on the
    CPU, where every path is its formulas: each row has its timings, a sweep's best shape, and
    the fused path within bf16 rounding of the path it replaces — a broken row shows here,
    not in a device call."""
    from bench_latency import codec_conv_bench as bench

    sweep = bench.SWEEP[:2]
    row = bench.conv_row(1, 32, 8, 7, 3, sweep, device="cpu")
    assert row["cudnn_ms"] > 0 and row["best_config"] and row["max_abs_vs_cudnn"] < 0.05
    plan = cc.Plan(((32, 7, 3, 8, cc.Config(64, 64, 32)),))
    row = bench.unit_row(1, 32, 8, 3, plan, bench.UNIT_SWEEP[:2], device="cpu")
    assert row["two_convs_fused"] == [True, False] and row["best_config"]
    assert row["max_abs_vs_two_convs"] < 0.05
    row = bench.up_row(1, 32, 8, 2, sweep, device="cpu")
    assert row["k"] == 4 and row["best_config"] and row["max_abs_vs_cudnn"] < 0.05


@needs_cuda
def test_cuda_units_and_transposed_convs_stream_through_the_plan(monkeypatch):
    """A Snake + transposed conv + residual unit (32 channels) streamed in bf16 on the GPU,
    channels-last, with a plan that takes the fused unit and the transposed conv as the
    fused conv: each chunk goes through both kernels, and the stream stays as close to the
    float32 offline block as the stream through the plan without them."""
    import engine.codec.layers as layers
    from engine.codec.layers import CausalConvTranspose1d, ResidualUnit, Snake1d
    from engine.ops import build_ops

    calls = []
    for name in ("residual_unit", "upsample"):
        fn = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n),
                                                                          _fn(*a, **k))[1])
    torch.manual_seed(0)
    block = torch.nn.Sequential(Snake1d(32), CausalConvTranspose1d(32, 32, 4, 2),
                                ResidualUnit(32, dilation=3)).eval()
    for m in block.modules():
        if isinstance(m, Snake1d):
            m.alpha.data = torch.rand_like(m.alpha) + 0.3
    x = torch.randn(2, 32, 50)
    with torch.no_grad():
        want = block(x)
    base = build_ops("cuda").codec
    assert base.conv_plan is not None, "the codec conv plan did not build"
    both = cc.Plan((), ((32, 0, 3, 1, cc.Config(32, 32, 32, 4, 2)),),
                   ((32, 4, 2, 1, cc.Config(32, 64, 32, 4, 2)),))
    errs = {}
    block = block.cuda().to(torch.bfloat16)
    for name, plan in (("fused", both), ("plain", cc.Plan())):
        calls.clear()
        ops = dataclasses.replace(base, conv_plan=plan)
        got, _ = stream_vs_offline(block, x.cuda().to(torch.bfloat16), ops, channels_last=True)
        errs[name] = float((got.float().cpu() - want).norm() / want.norm())
        # a one-sample chunk's [B, C, 1] input counts as channels-first (it is both), so its
        # transposed conv stays cuDNN's; its output (two samples) is channels-last again
        fused = [f for a, b in CUTS for f in (["upsample"] if b - a > 1 else []) + ["residual_unit"]]
        assert calls == (fused if name == "fused" else []), calls
    assert errs["fused"] <= 1.1 * errs["plain"] + 1e-3, errs
