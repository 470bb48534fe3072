"""engine/kernels/fp8_triton.py: the contract, the torch fallback, the config table, and (on
CUDA with Triton) the kernels against the reference.

Tolerance of the kernel (weight-only): it multiplies bf16 x by e4m3 W exactly (e4m3 fits in
bf16), accumulates in fp32 and rounds once to bf16, so against a float64 reference of
x @ dequantised(W)^T each output may be off by bf16's rounding (2^-8 relative) plus the fp32
accumulation error (bounded here by 1e-5 of sum_k |x_k w_k|). Against engine.quant's
`fp8_linear_torch` (which also rounds W to bf16 and runs a bf16 GEMM) the bound is looser:
2^-7 relative plus 2^-8 of sum_k |x_k w_k|.

With TRITON_INTERPRET=1 and triton importable, the `interp` tests run the same Triton kernels
on the CPU through Triton's interpreter (the interpreter's bf16 dot and float rounding are
patched with torch's, see `_patch_interpreter`).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.kernels import fp8_triton as ft
from engine.quant import Fp8Weight, dequantize_fp8, fp8_linear_torch, quantize_fp8

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available() and ft.available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and ft._triton_importable()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (sm_89+) and Triton")
needs_interp = pytest.mark.skipif(not INTERPRET,
                                  reason="needs TRITON_INTERPRET=1 and triton importable")

MS = (1, 2, 5, 16, 17, 64, 200)
SHAPES = ((6144, 2560), (2560, 4096), (2560, 9728), (19456, 2560), (4097, 2560), (300, 260))


# ------------------------------------------------------------------------------ helpers
def make_weight(n: int, k: int, device: str = "cpu", seed: int = 0) -> Fp8Weight:
    """A random weight whose 128 x 128 blocks differ in magnitude by up to e^6 (so a kernel
    that reads the wrong scale is far off), quantised."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device)
    nb, kb = -(-n // 128), -(-k // 128)
    mag = torch.exp(torch.rand(nb, kb, generator=g, device=device) * 6 - 3)
    w = w * mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return quantize_fp8(w * 0.05)


def make_x(m: int, k: int, device: str = "cpu", seed: int = 1, pad: int = 0,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [m, k]; with `pad`, rows strided (a view of [m, k + pad])."""
    g = torch.Generator(device=device).manual_seed(seed)
    buf = torch.randn(m, k + pad, generator=g, device=device).to(dtype)
    return buf[:, :k]


def reference(x: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ dequantised W^T, sum_k |x_k w_k|), in float64, [..., N]."""
    wd = dequantize_fp8(w, torch.float64)
    xd = x.double()
    return xd @ wd.T, xd.abs() @ wd.abs().T


def assert_product(out: torch.Tensor, x: torch.Tensor, wd: torch.Tensor,
                   what: str = "the product") -> None:
    """`out` against x @ wd^T in float64 (wd: the weight as the kernel multiplies it, in
    float64): bf16's rounding of the output plus the fp32 accumulation (1e-5 of
    sum_k |x_k w_k|)."""
    ref, mag = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = (out.double() - ref).abs()
    bound = 2**-8 * ref.abs() + 1e-5 * mag + 1e-30
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs off {what}; worst "
                           f"{float((err / bound).max()):.3g} x the bound")


def assert_matches(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight, *, exact: bool = True,
                   prescaled: bool = False):
    """`out` against the exact product: to the kernel's rounding (`exact`: bf16 output,
    float32 sums) or to fp8_linear_torch's (its weight rounded to x's dtype first). A
    `prescaled` kernel rounds the weight as fp8_linear_torch does, so it is held to the
    kernel's rounding around that weight's exact product."""
    if prescaled:
        assert_product(out, x, dequantize_fp8(w, x.dtype).double(), "the prescaled product")
        assert_matches(out, x, w, exact=False)
        return
    ref, mag = reference(x, w)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = (out.double() - ref).abs()
    if exact:  # the kernel: bf16 rounding + fp32 accumulation
        bound = 2**-8 * ref.abs() + 1e-5 * mag + 1e-30
    else:  # fp8_linear_torch (W rounded to bf16, bf16 GEMM)
        bound = 2**-7 * ref.abs() + 2**-8 * mag + 1e-30
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs off; worst "
                           f"{float((err / bound).max()):.3g} x the bound")


def assert_w8a8(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight):
    """The W8A8 kernel against its torch reference (same activation rounding; a rare tie or
    division ulp may round one element of x differently: 2^-9 of sum |x w| allows a few) and
    against the exact product (e4m3's rounding of x: a few % in the RMS)."""
    want = ft.fp8_linear_w8a8_torch(x, w).double()
    ref, mag = reference(x, w)
    err = (out.double() - want).abs()
    bound = 2**-7 * want.abs() + 2**-9 * mag + 1e-30
    assert not (err > bound).any(), f"worst {float((err / bound).max()):.3g} x the bound"
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 0.06, f"W8A8 relative error {float(rel):.3g}"


# -------------------------------------------------------------------------- CPU: import
def test_module_imports_and_falls_back_without_triton():
    """With `import triton` failing, the module imports, available() is False, and the
    wrapper runs the torch reference."""
    code = textwrap.dedent("""
        import sys
        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("no triton here")
        sys.meta_path.insert(0, NoTriton())
        import torch
        from engine.kernels import fp8_triton as ft
        from engine.quant import quantize_fp8, fp8_linear_torch
        assert not ft.available()
        assert "triton" not in sys.modules
        w = quantize_fp8(torch.randn(40, 72))
        x = torch.randn(3, 72).to(torch.bfloat16)
        assert torch.equal(ft.fp8_linear_triton(x, w), fp8_linear_torch(x, w))
        assert ft.configs() and ft.default_config(1, 40, 72)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_not_available_without_cuda():
    assert not ft.available()


@pytest.mark.parametrize("m,n,k", [(1, 300, 260), (5, 256, 128), (17, 130, 384)])
def test_fallback_matches_reference(m, n, k):
    w = make_weight(n, k)
    x = make_x(m, k, pad=8)
    out = ft.fp8_linear_triton(x, w)
    assert torch.equal(out, fp8_linear_torch(x, w))
    assert_matches(out, x, w, exact=False)
    x3 = make_x(2 * m, k).view(2, m, k)
    assert torch.equal(ft.fp8_linear_triton(x3, w, kernel=False), fp8_linear_torch(x3, w))


def test_w8a8_fallback_close_to_reference():
    w = make_weight(300, 260)
    x = make_x(7, 260)
    out = ft.fp8_linear_triton_w8a8(x, w)
    assert out.shape == (7, 300) and out.dtype == torch.bfloat16
    assert_w8a8(out, x, w)


# ------------------------------------------------------------------------ CPU: contract
def _misaligned_x(m: int, k: int) -> torch.Tensor:
    return torch.zeros(m * k + 8, dtype=torch.bfloat16)[1:1 + m * k].view(m, k)


W = make_weight(256, 384)
CONTRACT = [
    ("float32", lambda: ft.fp8_linear_triton(torch.zeros(2, 384), W), "bfloat16 or float16"),
    ("K", lambda: ft.fp8_linear_triton(torch.zeros(2, 383, dtype=torch.bfloat16), W), "K = 384"),
    ("last dim", lambda: ft.fp8_linear_triton(
        torch.zeros(384, 2, dtype=torch.bfloat16).t(), W), "contiguous"),
    ("aligned", lambda: ft.fp8_linear_triton(_misaligned_x(2, 384), W), "16-byte"),
    ("q dtype", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16),
        Fp8Weight(W.q.to(torch.bfloat16), W.scale)), "float8_e4m3fn"),
    ("scale shape", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16),
        Fp8Weight(W.q, W.scale.t().contiguous())), "block scales"),
    ("scale dtype", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), Fp8Weight(W.q, W.scale.half())), "float32"),
    ("dense weight", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), torch.zeros(256, 384)), "Fp8Weight"),
    ("block_n", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, config=ft.Config(16, 96, 128)),
     "block_n"),
    ("block_k", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, config=ft.Config(16, 64, 256)),
     "block_k"),
    ("block_m", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, config=ft.Config(8, 64, 128)),
     "block_m"),
    ("w8a8 block_k", lambda: ft.fp8_linear_triton_w8a8(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, config=ft.Config(16, 64, 64)),
     "W8A8"),
    ("config type", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, config=(16, 64, 128)), "Config"),
    ("split_k<0", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, split_k=-1), "split_k"),
    ("split_k bool", lambda: ft.fp8_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, split_k=True), "split_k"),
]


def test_aligned_strided_rows_pass_the_contract():
    x = make_x(3, 384, pad=8)  # rows strided, base aligned
    ft.check(x, W)
    ft.check(torch.zeros(0, 384, dtype=torch.bfloat16), W)


WD = torch.zeros(256, 384, dtype=torch.bfloat16)
DENSE_CONTRACT = [
    ("not 2-D", lambda: ft.dense_linear_triton(torch.zeros(2, 384, dtype=torch.bfloat16),
                                               WD[None]), r"\[N, K\] weight"),
    ("fp8 weight", lambda: ft.dense_linear_triton(torch.zeros(2, 384, dtype=torch.bfloat16),
                                                  W), r"\[N, K\] weight"),
    ("dtypes differ", lambda: ft.dense_linear_triton(torch.zeros(2, 384, dtype=torch.float16),
                                                     WD), "bfloat16 or both float16"),
    ("float32", lambda: ft.dense_linear_triton(torch.zeros(2, 384), WD.float()),
     "bfloat16 or both float16"),
    ("strided weight", lambda: ft.dense_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16),
        torch.zeros(256, 400, dtype=torch.bfloat16)[:, :384]), "must be contiguous"),
    ("K", lambda: ft.dense_linear_triton(torch.zeros(2, 383, dtype=torch.bfloat16), WD),
     "K = 384"),
    ("aligned", lambda: ft.dense_linear_triton(_misaligned_x(2, 384), WD), "16-byte"),
    ("prescale", lambda: ft.dense_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), WD,
        config=ft.Config(16, 64, 128, prescale=True)), "no scales"),
    ("split_k", lambda: ft.dense_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), WD, split_k=-2), "split_k"),
]


@pytest.mark.parametrize("call,match", [(c, m) for _, c, m in CONTRACT + DENSE_CONTRACT],
                         ids=[i for i, _, _ in CONTRACT] + [f"dense {i}" for i, _, _ in
                                                           DENSE_CONTRACT])
def test_contract(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_dense_fallback_is_f_linear():
    """Off CUDA (or with kernel=False) the dense GEMM is F.linear, rows strided or not."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(200, 384, generator=g).to(torch.bfloat16)
    for x in (make_x(5, 384, pad=8), make_x(1, 384), make_x(2, 384).view(1, 2, 384)):
        out = ft.dense_linear_triton(x, w, config=ft.Config(16, 64, 128), split_k=2)
        assert torch.equal(out, torch.nn.functional.linear(x, w))
    assert ft.dense_linear_triton(torch.zeros(0, 384, dtype=torch.bfloat16), w).shape == (0, 200)


def test_dense_sweep_configs():
    """The dense GEMM's configs per M bucket (8-64 rows): valid for dense weights, among
    `configs()` (so the GPU tests run them), the bucket's rows or unswapped 64-row tiles;
    none above 64 rows; a dense config round-trips through a plan's JSON."""
    every = set(ft.configs())
    for m in (1, 8, 16, 17, 32, 33, 64):
        bucket = 16 if m <= 16 else (32 if m <= 32 else 64)
        sweep = ft.sweep_configs(m, dense=True)
        assert sweep and set(sweep) <= every, m
        assert any(c.swap_ab for c in sweep) and any(not c.swap_ab for c in sweep)
        for c in sweep:
            c.check(dense=True)
            assert c.block_m == bucket or (not c.swap_ab and c.block_m == 64)
            assert ft.Config.from_json(c.to_json()) == c
    assert ft.sweep_configs(65, dense=True) == ()
    with pytest.raises(ValueError, match="no W8A8"):
        ft.sweep_configs(16, w8a8=True, dense=True)
    # dense tiles hold 16-bit weights: fit_smem counts two bytes per weight, no scratch
    cfg = ft.Config(64, 128, 128, 4, 4)
    assert ft.fit_smem(cfg, 170 * 1024, dense=True).num_stages == 3  # 3 x 48 KiB
    assert ft.fit_smem(cfg, 170 * 1024).num_stages == 4  # 4 x 32 KiB + 32 KiB


# --------------------------------------------------------------------- CPU: the configs
def test_configs_valid_and_table_in_them():
    cs = ft.configs()
    assert len(cs) == len(set(cs)) >= 10
    for c in cs:
        c.check()
    for c in ft.configs(w8a8=True):
        c.check(w8a8=True)
    for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 512, 4096):
        for n, k in SHAPES:
            c = ft.default_config(m, n, k)
            c.check()
            assert c.block_m >= min(m, 16) and (m > 16 or c.block_m == 16)
            ft.default_config(m, n, k, w8a8=True).check(w8a8=True)


def test_sweep_configs_are_candidates_and_round_trip():
    """linear_bench's few configs per M bucket: among `configs()` (so the GPU tests run
    them), tiles of the bucket's rows, and recorded in a plan as JSON and read back."""
    every, every8 = set(ft.configs()), set(ft.configs(w8a8=True))
    for m in (1, 2, 16, 17, 32, 33, 64):
        bucket = 16 if m <= 16 else (32 if m <= 32 else 64)
        for w8a8, pool in ((False, every), (True, every8)):
            sweep = ft.sweep_configs(m, w8a8=w8a8)
            assert sweep and set(sweep) <= pool, (m, w8a8)
            # the bucket's rows, or the unswapped prescaled 64-row tile (x's rows padded)
            assert all(c.block_m == bucket or (c.prescale and not c.swap_ab and c.block_m == 64)
                       for c in sweep)
            for c in sweep:
                c.check(w8a8=w8a8)
                assert ft.Config.from_json(c.to_json(), w8a8=w8a8) == c
        assert ft.sweep_configs(m)[0] == ft.default_config(m, 6144, 2560)  # the table's
    assert any(c.swap_ab for c in ft.sweep_configs(64))
    assert ft.sweep_configs(65) == (ft.default_config(65, 4096, 4096),)
    cfg = ft.Config(16, 64, 64).to_json()
    ft.Config.from_json(cfg)
    with pytest.raises(ValueError, match="W8A8"):
        ft.Config.from_json(cfg, w8a8=True)
    with pytest.raises(ValueError, match="unknown"):
        ft.Config.from_json({**cfg, "stages": 3})
    with pytest.raises(ValueError, match="must be an int"):
        ft.Config.from_json({**cfg, "block_m": "16"})
    assert any(c.prescale for c in ft.sweep_configs(64))
    assert not any(c.prescale for c in ft.sweep_configs(64, w8a8=True))
    with pytest.raises(ValueError, match="weight-only"):
        ft.Config.from_json({**ft.Config(16, 64, 128).to_json(), "prescale": True}, w8a8=True)
    with pytest.raises(ValueError, match="true or false"):
        ft.Config.from_json({**cfg, "prescale": 1})
    pre = ft.Config(16, 64, 128, swap_ab=True, prequant=True)
    assert ft.Config.from_json(pre.to_json(), w8a8=True) == pre
    # plans recorded before the field: read as False
    assert ft.Config.from_json({k: v for k, v in pre.to_json().items() if k != "prequant"},
                               w8a8=True).prequant is False
    with pytest.raises(ValueError, match="prequant"):
        ft.Config.from_json(pre.to_json())  # a weight-only row
    with pytest.raises(ValueError, match="true or false"):
        ft.Config.from_json({**pre.to_json(), "prequant": 1}, w8a8=True)
    assert any(c.prequant for c in ft.sweep_configs(64, w8a8=True))
    for m in (65, 128, 512):  # prefill's rows: the table's entry, then prequantised tiles
        big = ft.sweep_configs(m, w8a8=True)
        assert big[0] == ft.default_config(m, 4096, 4096, w8a8=True)
        assert any(c.prequant and c.block_m == 128 for c in big)
        assert set(big) <= set(ft.configs(w8a8=True))
    assert ft.fit_smem(ft.Config(64, 128, 128, 4, 8, prequant=True), 99 * 1024,
                       w8a8=True).num_stages == 4  # x in 8 bits: 24 KiB a stage


@pytest.mark.parametrize("m,n,k", [(1, 2560, 9728), (64, 19456, 2560), (5, 300, 260)])
def test_launch_split_is_what_runs(m, n, k):
    for cfg in ft.sweep_configs(m):
        assert ft.launch_split(m, n, k, cfg, 0, 132) == ft.auto_split_k(m, n, k, cfg, 132)
        kb = -(-k // 128)
        for s in (1, 3, 100):
            assert ft.launch_split(m, n, k, cfg, s, 132) == ft.normalise_split(kb, s)


def test_fit_smem_lowers_stages_only_when_needed():
    for w8a8 in (False, True):
        for m in (1, 17, 64, 128, 512):
            c = ft.default_config(m, 2560, 9728, w8a8=w8a8)
            assert ft.fit_smem(c, 227 * 1024, w8a8=w8a8) == c  # Hopper: the table as is
            assert ft.fit_smem(c, None, w8a8=w8a8) == c
            small = ft.fit_smem(c, 99 * 1024, w8a8=w8a8)  # sm_89
            assert small.num_stages <= c.num_stages and small.block_m == c.block_m
            per = c.block_m * c.block_k * 2 + c.block_n * c.block_k
            assert small.num_stages == 1 or small.num_stages * per <= 99 * 1024


@pytest.mark.parametrize("m,n,k", [(1, 2560, 9728), (1, 6144, 2560), (1, 2560, 4096),
                                   (5, 19456, 2560), (200, 2560, 9728)])
def test_auto_split_fills_the_gpu(m, n, k):
    sms = 132
    c = ft.default_config(m, n, k)
    split = ft.auto_split_k(m, n, k, c, sms)
    tiles = -(-m // c.block_m) * -(-n // c.block_n)
    kb = -(-k // 128)
    assert 1 <= split <= kb and ft.normalise_split(kb, split) == split
    assert tiles * split >= sms or split >= kb // 2, (tiles, split)
    if tiles >= sms:
        assert split == 1


def test_normalise_split_leaves_no_split_empty():
    for kb in range(1, 80):
        for s in range(1, kb + 5):
            got = ft.normalise_split(kb, s)
            per = -(-kb // got)
            assert 1 <= got <= min(s, kb) and (got - 1) * per < kb <= got * per


# ------------------------------------------------------------------------- CUDA: kernel
@functools.cache
def cuda_weight(n: int, k: int) -> Fp8Weight:
    return make_weight(n, k, device="cuda", seed=n * 7 + k)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_kernel_matches_reference(m, n, k):
    w = cuda_weight(n, k)
    x = make_x(m, k, device="cuda", seed=m)
    out = ft.fp8_linear_triton(x, w)
    assert_matches(out, x, w)
    ref = fp8_linear_torch(x, w).double()
    ref64, mag = reference(x, w)
    assert ((out.double() - ref).abs() <= 2**-7 * ref64.abs() + 2**-8 * mag + 1e-30).all()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", (1, 17, 200))
def test_kernel_strided_rows_and_leading_dims(m):
    w = cuda_weight(2560, 4096)
    x = make_x(m, 4096, device="cuda", pad=64)
    assert x.stride(0) == 4160
    assert_matches(ft.fp8_linear_triton(x, w), x, w)
    x3 = make_x(2 * m, 4096, device="cuda").view(2, m, 4096)
    out3 = ft.fp8_linear_triton(x3, w)
    assert out3.shape == (2, m, 2560)
    assert_matches(out3, x3, w)
    xh = make_x(m, 4096, device="cuda", pad=64, dtype=torch.float16)
    assert_matches(ft.fp8_linear_triton(xh, w), xh, w)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", (1, 5, 64))
def test_kernel_every_split_k(m):
    n, k = 2560, 4096  # 32 K blocks
    w = cuda_weight(n, k)
    x = make_x(m, k, device="cuda", seed=3)
    for split in (0, *range(1, 34), 100):
        assert_matches(ft.fp8_linear_triton(x, w, split_k=split), x, w)
    n, k = 300, 260  # 3 K blocks, the last partial
    w = cuda_weight(n, k)
    x = make_x(m, k, device="cuda", seed=4)
    for split in (0, 1, 2, 3, 4):
        assert_matches(ft.fp8_linear_triton(x, w, split_k=split), x, w)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", (1, 17, 200))
def test_kernel_every_config(m):
    n, k = 4097, 2560
    w = cuda_weight(n, k)
    x = make_x(m, k, device="cuda", seed=5)
    for cfg in ft.configs():
        for split in (1, 3):
            try:
                assert_matches(ft.fp8_linear_triton(x, w, config=cfg, split_k=split), x, w,
                               prescaled=cfg.prescale)
            except AssertionError as e:
                raise AssertionError(f"{cfg} split_k={split}: {e}") from None


@needs_cuda
@pytest.mark.cuda
def test_kernel_uses_the_scales():
    """The K-major scale bug: the right numbers in the wrong order (scale.t().contiguous()
    read as [nb, kb]) pass the layout check but must give a large error."""
    n, k = 6144, 2560
    w = cuda_weight(n, k)
    bad = Fp8Weight(w.q, w.scale.t().contiguous().view(w.scale.shape))
    x = make_x(16, k, device="cuda")
    ref, _ = reference(x, w)
    out = ft.fp8_linear_triton(x, bad).double()
    assert (out - ref).norm() / ref.norm() > 0.5
    assert_matches(ft.fp8_linear_triton(x, w), x, w)


@needs_cuda
@pytest.mark.cuda
def test_kernel_deterministic_and_graph_capturable():
    w = cuda_weight(2560, 9728)
    x = make_x(1, 9728, device="cuda")
    first = ft.fp8_linear_triton(x, w)  # compiles
    for _ in range(3):
        assert torch.equal(ft.fp8_linear_triton(x, w), first)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ft.fp8_linear_triton(static_x, w)
    static_x.copy_(make_x(1, 9728, device="cuda", seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, ft.fp8_linear_triton(static_x, w))
    assert_matches(static_out, static_x, w)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("n,k", ((2560, 4096), (4097, 2560), (300, 260)))
@pytest.mark.parametrize("m", (1, 17, 200))
def test_w8a8_kernel(m, n, k):
    w = cuda_weight(n, k)
    x = make_x(m, k, device="cuda", seed=m + 1, pad=8)
    assert_w8a8(ft.fp8_linear_triton_w8a8(x, w), x, w)
    for cfg in ft.configs(w8a8=True):
        assert_w8a8(ft.fp8_linear_triton_w8a8(x, w, config=cfg, split_k=2), x, w)


def _prequant_case(device: str, m: int, n: int, k: int) -> None:
    """The prequantised W8A8 configs give the in-kernel quantisation's output bit for bit
    (the same operations on the same values), and `quantize_act` its e4m3 values and
    scales."""
    import dataclasses

    w = make_weight(n, k, seed=5) if device == "cpu" else cuda_weight(n, k)
    x = make_x(m, k, device=device, seed=6, pad=8)
    for cfg in (ft.Config(16, 64, 128, swap_ab=True), ft.Config(64, 64, 128)):
        pre = dataclasses.replace(cfg, prequant=True)
        for split in (1, 2):
            a = ft._launch(x, w.q, w.scale, cfg, split, sms=132, w8a8=True)
            b = ft._launch(x, w.q, w.scale, pre, split, sms=132, w8a8=True)
            assert torch.equal(a, b), (cfg, split)
            assert_w8a8(b, x, w)
    q, sc = ft.quantize_act(x)  # true divisions: the reference's values exactly
    qr, sr = ft.quantize_act_torch(x)
    assert torch.equal(sc, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 300, 260), (17, 2560, 4096), (64, 19456, 2560)])
def test_w8a8_prequant_is_the_in_kernel_quantisation(m, n, k):
    _prequant_case("cuda", m, n, k)


def _dense_case(device: str, m: int, n: int, k: int, splits=(1, 2)) -> None:
    """Every dense sweep config of m's bucket (and the default table's) at each split, rows
    strided, against the float64 product; a leading batch dim and fp16 through the wrapper."""
    g = torch.Generator(device=device).manual_seed(n + k + m)
    w = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
    x = make_x(m, k, device=device, seed=m, pad=8)
    for cfg in (*ft.sweep_configs(m, dense=True), ft.default_config(m, n, k)):
        for split in splits:
            try:
                assert_product(ft._launch(x, w, None, cfg, split, sms=132), x, w.double())
            except AssertionError as e:
                raise AssertionError(f"{cfg} split {split}: {e}") from None
    if device == "cuda":
        x3 = make_x(2 * m, k, device=device, seed=m + 1).view(2, m, k)
        assert_product(ft.dense_linear_triton(x3, w).view(2 * m, n), x3.view(2 * m, k), w.double())
        wh, xh = w.half(), make_x(m, k, device=device, seed=3, dtype=torch.float16)
        assert_product(ft.dense_linear_triton(xh, wh), xh, wh.double())


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", (8, 16, 17, 32, 64))
@pytest.mark.parametrize("n,k", ((6144, 2560), (2560, 9728), (4097, 2560), (300, 260)))
def test_dense_kernel_matches_the_product(m, n, k):
    _dense_case("cuda", m, n, k, splits=(0, 1, 3))


@needs_cuda
@pytest.mark.cuda
def test_dense_kernel_graph_capturable():
    w = (torch.randn(2560, 4096, device="cuda") / 64).to(torch.bfloat16)
    x = make_x(64, 4096, device="cuda", seed=2)
    cfg = ft.sweep_configs(64, dense=True)[0]
    want = ft.dense_linear_triton(x, w, config=cfg, split_k=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ft.dense_linear_triton(x, w, config=cfg, split_k=2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


# ------------------------------------------------------------- interpreter (CPU, opt-in)
def _patch_interpreter(monkeypatch):
    """Triton 3.9's interpreter multiplies bf16 dot operands as their uint16 bits and rounds
    float down-casts by truncation (or carries a mantissa overflow wrongly); swap in torch's
    conversions (round to nearest even, as the GPU does) and an fp32 matmul."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    torch_of = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16,
                tl.float16: torch.float16, tl.float8e4nv: torch.float8_e4m3fn,
                tl.float8e5: torch.float8_e5m2}
    ints = {8: torch.int8, 16: torch.int16, 32: torch.int32}
    original = ti._convert_float

    def convert(data, src, dst, rounding_mode):
        if src not in torch_of or dst not in torch_of:
            return original(data, src, dst, rounding_mode)
        bits = np.ascontiguousarray(data).view(f"int{src.primitive_bitwidth}")
        t = torch.from_numpy(bits.copy()).view(torch_of[src]).to(torch_of[dst])
        out = t.view(ints[dst.primitive_bitwidth]).numpy()
        return out.view(f"uint{dst.primitive_bitwidth}").reshape(data.shape)

    def as_f32(h):
        if h.dtype in torch_of and h.dtype != tl.float32:
            return convert(h.data, h.dtype, tl.float32, None).view(np.float32)
        return h.data.astype(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = np.matmul(as_f32(a), as_f32(b)).astype(d.data.dtype) + d.data
        return ti.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(ti, "_convert_float", convert)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def interp(monkeypatch):
    _patch_interpreter(monkeypatch)


INTERP_CASES = [(1, 300, 260), (5, 300, 260), (17, 300, 260), (2, 640, 1024),
                (1, 130, 2560), (33, 200, 384)]


@needs_interp
@pytest.mark.parametrize("m,n,k", INTERP_CASES)
def test_interp_kernel_matches_reference(interp, m, n, k):
    w = make_weight(n, k, seed=n + k)
    x = make_x(m, k, seed=m, pad=8)
    cfg = ft.default_config(m, n, k)
    for split in (0, 1, 2):
        assert_matches(ft._launch(x, w.q, w.scale, cfg, split, sms=132), x, w)


@needs_interp
def test_interp_every_config(interp):
    n, k = 200, 384
    w = make_weight(n, k, seed=2)
    for m in (1, 17):
        x = make_x(m, k, seed=m, pad=8)
        for cfg in ft.configs():
            try:
                assert_matches(ft._launch(x, w.q, w.scale, cfg, 2, sms=132), x, w,
                               prescaled=cfg.prescale)
            except AssertionError as e:
                raise AssertionError(f"{cfg}: {e}") from None


@needs_interp
def test_interp_every_split_k(interp):
    n, k = 130, 1024 + 40  # 9 K blocks, the last partial
    w = make_weight(n, k, seed=3)
    x = make_x(3, k, seed=3)
    cfg = ft.Config(16, 64, 64)
    for split in range(1, 11):
        assert_matches(ft._launch(x, w.q, w.scale, cfg, split, sms=132), x, w)


@needs_interp
def test_interp_kernel_uses_the_scales(interp):
    n, k = 384, 640
    w = make_weight(n, k, seed=4)
    bad = Fp8Weight(w.q, w.scale.t().contiguous().view(w.scale.shape))
    x = make_x(4, k)
    ref, _ = reference(x, w)
    out = ft._launch(x, bad.q, bad.scale, ft.default_config(4, n, k), 1, sms=132).double()
    assert (out - ref).norm() / ref.norm() > 0.5


@needs_interp
@pytest.mark.parametrize("m,n,k", [(1, 300, 260), (17, 200, 384), (40, 130, 640)])
def test_interp_w8a8(interp, m, n, k):
    w = make_weight(n, k, seed=5)
    x = make_x(m, k, seed=6, pad=8)
    for cfg in (ft.default_config(m, n, k, w8a8=True), ft.Config(16, 32, 128, swap_ab=True)):
        for split in (1, 2):
            assert_w8a8(ft._launch(x, w.q, w.scale, cfg, split, sms=132, w8a8=True), x, w)


@needs_interp
@pytest.mark.parametrize("m,n,k", [(1, 300, 260), (17, 200, 384), (40, 130, 640)])
def test_interp_w8a8_prequant(interp, m, n, k):
    _prequant_case("cpu", m, n, k)


@needs_interp
@pytest.mark.parametrize("m,n,k", [(1, 200, 384), (17, 130, 1064), (40, 64, 640)])
def test_interp_dense(interp, m, n, k):
    _dense_case("cpu", m, n, k)


# ------------------------------------------- residual epilogue, prequantised x, act_quant
def assert_quant_close(got: ft.QuantAct, want: ft.QuantAct, *, exact: bool) -> None:
    """Two quantisations of one tensor: identical (`exact`), or as the kernels' float32 may
    leave them (a bf16 rounding of the norm or silu moved, which can move that element's
    e4m3 code by one step and, where it was a block's largest, the block's scale by a bf16
    ulp): at most 1 % of the codes and of the scales differ, each dequantised element within
    one e4m3 step (2^-3 relative) plus 2^-9 of its block's range."""
    assert got.q.shape == want.q.shape and got.s.shape == want.s.shape
    assert got.dtype == want.dtype
    gq, wq = got.q.view(torch.uint8), want.q.view(torch.uint8)
    if exact:
        assert torch.equal(gq, wq) and torch.equal(got.s, want.s)
        return
    assert (gq != wq).float().mean() <= 0.01
    assert ((got.s - want.s).abs() > 2**-7 * want.s.abs()).float().mean() == 0
    gd, wd = got.dequantize(), want.dequantize()
    bound = 2**-3 * wd.abs() + 448 * 2**-9 * want.s.repeat_interleave(128, -1)[..., :wd.shape[-1]]
    assert ((gd - wd).abs() <= bound).all()


def _act_quant_cases(device: str, exact: bool) -> None:
    """The norm and the gate kernels (through their launches: the CPU has no CUDA tensors)
    against the torch references: S2-Pro's dim and an odd one (a partial last block), rows
    strided, bf16 and fp16, a row of zeros."""
    from engine.kernels import act_quant as aq

    for m, k, dtype in ((1, 2560, torch.bfloat16), (17, 300, torch.bfloat16),
                        (5, 2560, torch.float16)):
        g = torch.Generator(device=device).manual_seed(m + k)
        h = (torch.randn(m, k + 8, generator=g, device=device) * 3).to(dtype)[:, :k]
        h[0, :] = 0 if m > 1 else h[0, :]
        nw = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(dtype)
        q, s = aq._launch_norm(h, nw, 1e-5)
        assert_quant_close(ft.QuantAct(q, s, dtype), aq.rms_norm_quant_torch(h, nw, 1e-5),
                           exact=exact)
        gu = (torch.randn(m, 2 * k, generator=g, device=device) * 2).to(dtype)
        a, b = gu[:, :k], gu[:, k:]  # the packed projection's halves: rows 2k apart
        q, s = aq._launch_glu(a, b)
        assert_quant_close(ft.QuantAct(q, s, dtype), aq.silu_mul_quant_torch(a, b),
                           exact=exact)


def _residual_and_prequant_case(device: str, m: int, n: int, k: int) -> None:
    """The residual epilogue (unsplit, split: the reduce adds it) == the same launch's
    product, then the add, bit for bit, for each weight kind; the GEMM over prequantised x
    (`xs`) == the prequant config's own quantisation, bit for bit, with a residual too."""
    w = make_weight(n, k, device=device, seed=7)
    wd = dequantize_fp8(w, torch.bfloat16)
    x = make_x(m, k, device=device, seed=8, pad=8)
    r = make_x(m, n, device=device, seed=9, pad=16)  # rows strided
    sms = 132
    for split in (1, 3):
        for q, scale, cfg, w8a8 in ((w.q, w.scale, ft.default_config(m, n, k), False),
                                    (w.q, w.scale, ft.Config(16, 64, 64, swap_ab=True), False),
                                    (w.q, w.scale, ft.Config(16, 64, 64, prescale=True), False),
                                    (wd, None, ft.Config(16, 64, 64), False),
                                    (wd, None, ft.Config(16, 64, 64, swap_ab=True), False),
                                    (w.q, w.scale, ft.Config(16, 64, 128, prequant=True), True),
                                    (w.q, w.scale, ft.Config(16, 64, 128, swap_ab=True,
                                                             prequant=True), True),
                                    (w.q, w.scale, ft.Config(16, 32, 128, swap_ab=True), True)):
            plain = ft._launch(x, q, scale, cfg, split, sms, w8a8=w8a8)
            fused = ft._launch(x, q, scale, cfg, split, sms, w8a8=w8a8, residual=r)
            assert torch.equal(fused, r + plain), (cfg, split)
        xq, xs = ft.quantize_act(x) if device == "cuda" else ft.quantize_act_torch(x)
        for pre in (ft.Config(16, 64, 128, prequant=True),
                    ft.Config(16, 64, 128, swap_ab=True, prequant=True)):
            a = ft._launch(x, w.q, w.scale, pre, split, sms, w8a8=True, residual=r)
            b = ft._launch(xq.contiguous(), w.q, w.scale, pre, split, sms, w8a8=True, xs=xs,
                           residual=r, out_dtype=x.dtype)
            assert torch.equal(a, b), (pre, split)
            assert_w8a8(ft._launch(xq.contiguous(), w.q, w.scale, pre, split, sms, w8a8=True,
                                   xs=xs, out_dtype=x.dtype), x, w)  # xs read as the rows'


def test_residual_and_prequant_fallbacks():
    """Off CUDA: each wrapper's residual is added after the reference product (as the
    epilogue rounds it), the prequantised GEMM's fallback is the W8A8 reference's product of
    the same values, and `QuantAct.dequantize` is what it multiplies."""
    from engine.kernels import act_quant as aq

    w = make_weight(300, 260, seed=1)
    x = make_x(2, 3 * 260, seed=2).view(2, 3, 260)
    r = make_x(6, 300, seed=3).view(2, 3, 300)
    assert torch.equal(ft.fp8_linear_triton(x, w, residual=r), r + fp8_linear_torch(x, w))
    assert torch.equal(ft.fp8_linear_triton_w8a8(x, w, residual=r),
                       r + ft.fp8_linear_w8a8_torch(x, w))
    wd = dequantize_fp8(w, torch.bfloat16)
    assert torch.equal(ft.dense_linear_triton(x, wd, residual=r),
                       r + torch.nn.functional.linear(x, wd))
    q, s = ft.quantize_act_torch(x.reshape(6, 260))
    xa = ft.QuantAct(q.contiguous().view(2, 3, 260), s.view(2, 3, 3), torch.bfloat16)
    assert torch.equal(ft.fp8_linear_triton_prequant(xa, w), ft.fp8_linear_w8a8_torch(x, w))
    assert torch.equal(ft.fp8_linear_triton_prequant(xa, w, residual=r),
                       r + ft.fp8_linear_w8a8_torch(x, w))
    xd = xa.dequantize()
    assert xd.dtype == torch.float32 and ((xd - x.float()).abs() <= 2**-3 * x.float().abs()
                                          + 1e-6).all()
    # the act_quant references are the unfused ops, then the quantisation, whatever the
    # leading dims and strides
    h = make_x(6, 260, seed=4)
    nw = make_x(1, 260, seed=5)[0]
    from engine import functional

    want = ft.quantize_act_torch(functional.rms_norm(h, nw, 1e-6))
    got = aq.rms_norm_quant(h.view(2, 3, 260), nw, 1e-6)
    assert torch.equal(got.q.view(6, 260).view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got.s.view(6, 3), want[1]) and got.dtype == torch.bfloat16
    gu = make_x(6, 520, seed=6)
    got = aq.silu_mul_quant(gu[:, :260], gu[:, 260:])
    want = ft.quantize_act_torch(torch.nn.functional.silu(gu[:, :260]) * gu[:, 260:])
    assert torch.equal(got.q.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got.s, want[1])


QA = ft.QuantAct(torch.zeros(2, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 2),
                 torch.bfloat16)
R_CONTRACT = [
    ("residual shape", lambda: ft.fp8_linear_triton(torch.zeros(2, 384, dtype=torch.bfloat16), W,
                                                    residual=torch.zeros(2, 255, dtype=torch.bfloat16)),
     r"residual \[2, 255\] must have the output's shape \[2, 256\]"),
    ("residual dtype", lambda: ft.fp8_linear_triton_w8a8(
        torch.zeros(2, 384, dtype=torch.bfloat16), W, residual=torch.zeros(2, 256)),
     "residual must be torch.bfloat16"),
    ("residual stride", lambda: ft.dense_linear_triton(
        torch.zeros(2, 384, dtype=torch.bfloat16), WD,
        residual=torch.zeros(256, 2, dtype=torch.bfloat16).t()), "last dim must be contiguous"),
    ("not a QuantAct", lambda: ft.fp8_linear_triton_prequant(
        torch.zeros(2, 384, dtype=torch.bfloat16), W), "takes a QuantAct"),
    ("QuantAct q dtype", lambda: ft.fp8_linear_triton_prequant(
        ft.QuantAct(torch.zeros(2, 384, dtype=torch.bfloat16), torch.ones(2, 3),
                    torch.bfloat16), W), "e4m3 q and float32 s"),
    ("QuantAct scales", lambda: ft.fp8_linear_triton_prequant(
        ft.QuantAct(torch.zeros(2, 384, dtype=torch.float8_e4m3fn), torch.ones(2, 2),
                    torch.bfloat16), W), r"expected \[2, 3\]"),
    ("QuantAct dtype", lambda: ft.fp8_linear_triton_prequant(
        ft.QuantAct(torch.zeros(2, 384, dtype=torch.float8_e4m3fn), torch.ones(2, 3),
                    torch.float32), W), "dtype must be bfloat16 or float16"),
    ("QuantAct K", lambda: ft.fp8_linear_triton_prequant(QA, W), "K = 384"),
    ("prequant w8a8 config", lambda: ft.fp8_linear_triton_prequant(
        ft.QuantAct(torch.zeros(2, 384, dtype=torch.float8_e4m3fn), torch.ones(2, 3),
                    torch.bfloat16), W, config=ft.Config(16, 64, 64)), "block_k"),
]


@pytest.mark.parametrize("call,match", [(c, m) for _, c, m in R_CONTRACT],
                         ids=[i for i, _, _ in R_CONTRACT])
def test_residual_and_prequant_contract(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_act_quant_contract():
    from engine.kernels import act_quant as aq

    h = torch.zeros(2, 256, dtype=torch.bfloat16)
    for call, match in (
            (lambda: aq.rms_norm_quant(h.float(), torch.ones(256), 1e-6), "bfloat16 or float16"),
            (lambda: aq.rms_norm_quant(h, torch.ones(255, dtype=torch.bfloat16), 1e-6),
             r"norm weight must be \[256\]"),
            (lambda: aq.rms_norm_quant(torch.zeros(256, 2, dtype=torch.bfloat16).t(),
                                       torch.ones(2, dtype=torch.bfloat16), 1e-6),
             "last dim must be contiguous"),
            (lambda: aq.rms_norm_quant(torch.zeros(1, aq.MAX_K + 128, dtype=torch.bfloat16),
                                       torch.ones(aq.MAX_K + 128, dtype=torch.bfloat16), 1e-6),
             "holds a row in registers"),
            (lambda: aq.silu_mul_quant(h, h[:, :128]), "a and b must match"),
            (lambda: aq.silu_mul_quant(h, h.half()), "a and b must match"),
            (lambda: aq.silu_mul_quant(torch.zeros(2, 0, dtype=torch.bfloat16),
                                       torch.zeros(2, 0, dtype=torch.bfloat16)), "K > 0")):
        with pytest.raises(ValueError, match=match):
            call()


@needs_interp
@pytest.mark.parametrize("m,n,k", [(1, 300, 260), (17, 200, 384)])
def test_interp_residual_and_prequant(interp, m, n, k):
    _residual_and_prequant_case("cpu", m, n, k)


@needs_interp
def test_interp_act_quant(interp):
    _act_quant_cases("cpu", exact=False)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 300, 260), (17, 2560, 4096), (64, 19456, 2560)])
def test_residual_epilogue_and_prequantised_x(m, n, k):
    _residual_and_prequant_case("cuda", m, n, k)


@needs_cuda
@pytest.mark.cuda
def test_act_quant_kernels():
    from engine.kernels import act_quant as aq

    _act_quant_cases("cuda", exact=False)
    # through the wrappers: 3-d, graph-capturable, the GEMM over them == the W8A8 GEMM of
    # the unfused ops' output where the quantisations agree
    h = make_x(2 * 16, 2560, device="cuda", seed=11).view(2, 16, 2560)
    nw = make_x(1, 2560, device="cuda", seed=12)[0]
    w = make_weight(6144, 2560, device="cuda", seed=13)
    xa = aq.rms_norm_quant(h, nw, 1e-6)
    assert xa.q.shape == (2, 16, 2560) and xa.s.shape == (2, 16, 20)
    want = ft.fp8_linear_triton_prequant(aq.rms_norm_quant_torch(h, nw, 1e-6), w)
    got = ft.fp8_linear_triton_prequant(xa, w)
    assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
    # every kernel specialisation the capture launches has run once (a module loaded
    # while a stream captures is an error)
    ft.fp8_linear_triton_prequant(aq.rms_norm_quant(h, nw, 1e-6), w, residual=got)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ft.fp8_linear_triton_prequant(aq.rms_norm_quant(h, nw, 1e-6), w, residual=got)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got + got)


def _glu_case(device: str, m: int, k: int, i: int) -> None:
    """The GLU GEMM (w13's W8A8 GEMM with silu * mul and the quantisation in its epilogue)
    against the prequantised GEMM's product then the quantising gate (its reference), in
    both tile orientations and with a partial last K block; exactly where the products
    agree, else as close as the kernels' float32 leaves two quantisations."""
    from engine.kernels import act_quant as aq

    w13 = make_weight(2 * i, k, device=device, seed=21)
    x = make_x(m, k, device=device, seed=22)
    xq, xs = ft.quantize_act(x) if device == "cuda" else ft.quantize_act_torch(x)
    xa = ft.QuantAct(xq.contiguous(), xs, x.dtype)
    want = aq.glu_w8a8_quant_torch(xa, w13)
    for cfg in (ft.Config(16, 128, 128, 4, 4, swap_ab=True), ft.Config(16, 128, 128, 4, 3),
                ft.Config(64, 128, 128, 4, 4, prequant=True)):
        q, s = aq._launch_glu_gemm(xa.q, xa.s, w13, i, cfg, x.dtype)
        assert_quant_close(ft.QuantAct(q, s, x.dtype), want, exact=False)


def test_glu_fallback_and_contract():
    """Off CUDA the GLU GEMM is its reference (the W8A8 product, then the quantising gate);
    its contract names N's blocks and the config's tiles."""
    from engine.kernels import act_quant as aq

    w13 = make_weight(512, 260, seed=1)
    x = make_x(6, 260, seed=2).view(2, 3, 260)
    q, s = ft.quantize_act_torch(x.reshape(6, 260))
    xa = ft.QuantAct(q.contiguous().view(2, 3, 260), s.view(2, 3, 3), torch.bfloat16)
    got = aq.glu_w8a8_quant(xa, w13)
    h = ft.fp8_linear_w8a8_torch(x, w13)
    want = aq.silu_mul_quant_torch(h[..., :256], h[..., 256:])
    assert got.q.shape == (2, 3, 256) and got.s.shape == (2, 3, 2)
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(got.s, want.s)
    with pytest.raises(ValueError, match="N a multiple of 256"):
        aq.glu_w8a8_quant(xa, make_weight(384, 260))
    with pytest.raises(ValueError, match="block_n = block_k = 128"):
        aq.glu_w8a8_quant(xa, w13, config=ft.Config(16, 64, 128))
    with pytest.raises(ValueError, match="takes a QuantAct"):
        aq.glu_w8a8_quant(x, w13)


@needs_interp
@pytest.mark.parametrize("m,k,i", [(1, 256, 256), (17, 260, 384)])
def test_interp_glu_gemm(interp, m, k, i):
    _glu_case("cpu", m, k, i)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", (1, 16, 17, 64))
def test_glu_gemm_kernel(m):
    _glu_case("cuda", m, 2560, 9728)
