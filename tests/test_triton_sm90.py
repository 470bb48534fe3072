"""The Triton kernels no GPU has run yet, compiled for sm_90 (H100 / H200) on the CPU: Triton
lowers them through ptxas (bundled with its wheel) for a GPUTarget without a device, so a
kernel that would not compile, would not fit in shared memory or would lose its software
pipelining shows here, before a device call. tests/test_triton_interpreter.py runs these in
its venv (triton pinned there; not under TRITON_INTERPRET, which turns `triton.jit` functions
into interpreted ones).

The signatures mirror a real launch's specialisation: pointers 16-byte aligned and the
integer strides / widths that are multiples of 16 at S2-Pro's shapes marked so (Triton
specialises them at launch; without the marks its axis analysis cannot prove 16-byte
vectors, and the loads neither vectorise nor pipeline).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from engine.kernels.fp8_triton import _triton_importable

RUN = _triton_importable() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(not RUN, reason="needs triton importable (not interpreted)")
SMEM = 227 * 1024  # sm_90's shared memory per block


def _compile(kernel, ptrs: dict[str, str], consts: dict, warps: int, stages: int, *,  # type: ignore[no-untyped-def]
             div16: tuple[str, ...] = (), floats: tuple[str, ...] = (), **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = f"*{ptrs[name]}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, **options})


def _spills(compiled) -> int:  # type: ignore[no-untyped-def]
    """Bytes of spill stores ptxas reports for the compiled kernel's PTX."""
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", _ptxas(compiled)))


def _ptxas(compiled) -> str:  # type: ignore[no-untyped-def]
    """ptxas -v's report (resources, warnings) on the compiled kernel's PTX."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ptx = Path(os.environ.get("TMPDIR", "/tmp")) / f"rtvoice_sm90_{os.getpid()}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    try:
        r = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o", os.devnull],
                           capture_output=True, text=True, timeout=300)
    finally:
        ptx.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def _async_copies(compiled) -> int:  # type: ignore[no-untyped-def]
    return compiled.asm["ttgir"].count("async_copy_global_to_local")


ATTN_PTRS = {n: "bf16" for n in ("q_ptr", "kn_ptr", "vn_ptr", "kc_ptr", "vc_ptr", "o_ptr",
                                  "cs_ptr", "qw_ptr", "kw_ptr")}
ATTN_PTRS |= {"tab_ptr": "i64", "wb_ptr": "i64", "pos_ptr": "i64", "st_ptr": "i32"}


@pytest.mark.parametrize("splits,rope,block_t,warps,stages", [
    (1, 0, 64, 4, 2), (4, 0, 64, 4, 2), (1, 2, 64, 4, 2), (32, 1, 64, 4, 2),  # the default
    (1, 0, 64, 8, 3), (4, 2, 32, 4, 3), (1, 0, 64, 4, 4), (1, 0, 64, 4, 3)])  # the bench's
def test_sm90_decode_attention_compiles_with_tiles_in_flight(splits, rope, block_t, warps,
                                                             stages):
    """S2-Pro's slow AR (32 heads over 8 kv heads, head_dim 128, the pool's 64-position
    pages), plain and with the fused q/k norm + RoPE: the key/value tiles go through async
    copies with stages - 1 tiles in flight (their page number loaded a tile ahead), within
    shared memory, no spills."""
    from engine.kernels import decode_attention_triton as tri

    attend, _, _ = tri._kernels()
    ptrs = ATTN_PTRS | {"ws_o_ptr": "fp32" if splits > 1 else "bf16",
                        "ws_ml_ptr": "fp32" if splits > 1 else "bf16"}
    k = _compile(attend, ptrs, dict(REP=4, QMR=tri.QM, D=128, DP=128, BS=64, BT=block_t,
                                    SPLITS=splits, ROPE=rope, SLOTS=splits), warps, stages,
                 div16=("q_rs", "kn_rs", "vn_rs", "o_rs", "tab_rs", "cs_rs"),
                 floats=("scale", "eps"), enable_fp_fusion=False)
    tile = 2 * block_t * 128 * 2  # one tile of keys and one of values, bf16
    assert (stages - 1) * tile <= k.metadata.shared <= SMEM, k.metadata.shared
    assert _async_copies(k) >= 2
    assert _spills(k) == 0


@pytest.mark.parametrize("splits,psplits,warps", [(1, 1, 4), (1, 4, 4), (2, 2, 8)])
def test_sm90_shared_prefix_attention_compiles_with_tiles_in_flight(splits, psplits, warps):
    """The shared-prefix (cascade) programs at S2-Pro's slow AR: 16 rows x 4 query heads as
    the dot's 64 rows against 64-position key/value tiles with tiles in flight, within shared
    memory, no spills; and the row programs that then start after the prefix (SLOTS)."""
    from engine.kernels import decode_attention_triton as tri

    attend, _, shared = tri._kernels()
    slots = splits + psplits
    rt = tri.prefix_rows_per_tile(32, 8)
    k = _compile(shared, {"q_ptr": "bf16", "kc_ptr": "bf16", "vc_ptr": "bf16", "tab_ptr": "i64",
                          "pos_ptr": "i64", "tr_ptr": "i32", "tlen_ptr": "i32", "ts_ptr": "i32",
                          "ws_o_ptr": "fp32", "ws_ml_ptr": "fp32"},
                 dict(REP=4, RT=rt, QMP=64, D=128, DP=128, BS=64, BT=64, SPLITS=splits,
                      SLOTS=slots, PSPLITS=psplits), warps, 3,
                 div16=("q_rs", "tab_rs"), floats=("scale",))
    assert rt == 16
    assert 2 * 64 * 128 * 2 <= k.metadata.shared <= SMEM, k.metadata.shared
    assert _async_copies(k) >= 2
    assert _spills(k) == 0
    ptrs = ATTN_PTRS | {"ws_o_ptr": "fp32", "ws_ml_ptr": "fp32"}
    k = _compile(attend, ptrs, dict(REP=4, QMR=tri.QM, D=128, DP=128, BS=64, BT=64,
                                    SPLITS=splits, ROPE=0, SLOTS=slots), 4, 3,
                 div16=("q_rs", "kn_rs", "vn_rs", "o_rs", "tab_rs", "cs_rs"),
                 floats=("scale", "eps"), enable_fp_fusion=False)
    assert k.metadata.shared <= SMEM and _async_copies(k) >= 2 and _spills(k) == 0


@pytest.mark.parametrize("splits", [2, 32])
def test_sm90_decode_attention_combine_compiles(splits):
    from engine.kernels import decode_attention_triton as tri

    _, combine, _ = tri._kernels()
    k = _compile(combine, {"ws_o_ptr": "fp32", "ws_ml_ptr": "fp32", "o_ptr": "bf16"},
                 dict(D=128, DP=128, SPLITS=splits, SP=max(2, 1 << (splits - 1).bit_length())),
                 4, 1, div16=("o_rs",))
    assert k.metadata.shared <= SMEM and _spills(k) == 0


@pytest.mark.parametrize("channels", [96, 192])
def test_sm90_codec_units_compile_in_every_swept_shape(channels):
    """The fused residual unit (`codec_conv.residual_unit`) at the S2-Pro decoder's widths,
    in every launch shape the bench sweeps and the default one: each compiles, fits in shared
    memory and pipelines its k=7 loads (some 192-channel shapes spill a little: the sweep
    measures whether they still win)."""
    from bench_latency.codec_conv_bench import UNIT_SWEEP
    from engine.kernels import codec_conv as cc

    unit = cc._unit_kernel()
    ptrs = {n: "bf16" for n in ("x_ptr", "w7_ptr", "b7_ptr", "a_ptr", "w1_ptr", "b1_ptr",
                                "r_ptr", "o_ptr")}
    m = 64 * 8 * 2048 * 96 // channels  # a 64 x 8 tick's rows at this width
    for cfg in (*UNIT_SWEEP, cc.unit_config_for(m, channels)):
        k = _compile(unit, ptrs, dict(TAPS=7, FAST_SIN=True, BM=cfg.block_m,
                                      NPC=cc._pow2(channels), BN=cfg.block_n, BK=cfg.block_k),
                     cfg.warps, cfg.stages,
                     div16=("C", "NP", "s_tap", "sxb", "sxt", "srb", "srt"))
        assert k.metadata.shared <= SMEM, (cfg, k.metadata.shared)
        assert _async_copies(k) >= 2, cfg


@pytest.mark.parametrize("m", [16, 32, 64])
def test_sm90_fp8_prescaled_gemm_keeps_wgmma_async_unswapped(m):
    """The Triton FP8 GEMM's prescaled configs that linear_bench times at up to m rows, at
    S2-Pro's w13 (19,456 x 2,560): all compile within shared memory, and the unswapped 64-row
    tiles (the dequantised weight through shared memory) keep their wgmmas asynchronous —
    with Triton 3.5 the swapped 128-deep ones (that tile as wgmma's register operand) get
    them serialised by ptxas (warning C7515), why the sweep carries the former
    (engine/kernels/fp8_triton.py)."""
    from engine.kernels import fp8_triton as ft

    gemm, _, _ = ft._kernels()
    ptrs = {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32", "out_ptr": "bf16",
            "xs_ptr": "fp32", "r_ptr": "bf16"}
    cfgs = [c for c in ft.sweep_configs(m) if c.prescale]
    assert any(not c.swap_ab for c in cfgs)
    for cfg in cfgs:
        k = _compile(gemm, ptrs, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                      BLOCK_K=cfg.block_k, EVEN_K=True, SWAP_AB=cfg.swap_ab,
                                      ACT_FP8=False, PRESCALE=True, X_Q=False, DENSE=False, RESIDUAL=False),
                     cfg.num_warps,
                     cfg.num_stages, div16=("N", "K", "stride_xm", "stride_om", "stride_os", "stride_rm"))
        report = _ptxas(k)
        assert k.metadata.shared <= SMEM and _spills(k) == 0, cfg
        if not cfg.swap_ab:
            assert "C7515" not in report, (cfg, report[-600:])


@pytest.mark.parametrize("m", [16, 32, 64, 512])
def test_sm90_fp8_prequantised_w8a8_gemm_has_no_conversion_in_its_loop(m):
    """The W8A8 configs with x quantised beforehand (`prequant`) at w13's shape: both dot
    operands e4m3 from shared memory through async copies, asynchronous wgmmas and no
    conversion in the main loop (the sweep's tiles put >= 64 rows on the MMA's M side: below
    that Triton's mma.sync path converts e4m3 operands to f16), within shared memory, no
    spills; and the quantisation launch compiles."""
    from engine.kernels import fp8_triton as ft

    gemm, _, quant = ft._kernels()
    cfgs = [c for c in ft.sweep_configs(m, w8a8=True) if c.prequant]
    assert cfgs
    for cfg in cfgs:
        out = "fp32"  # split-K partials (the sweep's splits > 1)
        k = _compile(gemm, {"x_ptr": "fp8e4nv", "q_ptr": "fp8e4nv", "s_ptr": "fp32",
                            "out_ptr": out, "xs_ptr": "fp32", "r_ptr": "bf16"},
                     dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          EVEN_K=True, SWAP_AB=cfg.swap_ab, ACT_FP8=True, PRESCALE=False,
                          X_Q=True, DENSE=False, RESIDUAL=False), cfg.num_warps, cfg.num_stages,
                     div16=("N", "K", "stride_xm", "stride_om", "stride_os", "stride_rm"))
        report = _ptxas(k)
        assert k.metadata.shared <= SMEM and _async_copies(k) >= 2, cfg
        assert "C7515" not in report and _spills(k) == 0, (cfg, report[-600:])
        ttgir = k.asm["ttgir"]
        assert "warp_group_dot " in ttgir, cfg
        assert "tt.fp_to_fp" not in ttgir.split("scf.for")[1].split("scf.yield")[0], cfg
    q = _compile(quant, {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
                 dict(BLOCK=128), 1, 1, div16=("K", "stride_xm"))
    assert _spills(q) == 0
    # true divisions in both quantisations (`/` is div.full.f32: an ulp off at times, and a
    # value on an e4m3 tie then rounds otherwise than quantize_act_torch)
    inloop = _compile(gemm, {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32",
                             "out_ptr": "fp32", "xs_ptr": "fp32", "r_ptr": "bf16"},
                      dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, SWAP_AB=False,
                           ACT_FP8=True, PRESCALE=False, X_Q=False, DENSE=False, RESIDUAL=False), 4, 4,
                      div16=("N", "K", "stride_xm", "stride_om", "stride_os", "stride_rm"))
    for k in (q, inloop):
        assert "div.full.f32" not in k.asm["ptx"] and "div.rn" in k.asm["ptx"]


@pytest.mark.parametrize("m", [16, 32, 64])
def test_sm90_dense_gemm_compiles_pipelined_with_async_wgmma(m):
    """The dense (bf16 weight) GEMM's configs that linear_bench times at up to m rows, at
    S2-Pro's w2 (2,560 x 9,728): within shared memory, no spills, both operands through
    async copies (pipelined), and wgmma for the tiles with 64 rows on the MMA's M side
    (x's rows unswapped, the weight's swapped), never serialised (warning C7515)."""
    from engine.kernels import fp8_triton as ft

    gemm, _, _ = ft._kernels()
    ptrs = {"x_ptr": "bf16", "q_ptr": "bf16", "s_ptr": "bf16", "out_ptr": "fp32",
            "xs_ptr": "bf16", "r_ptr": "bf16"}
    for cfg in ft.sweep_configs(m, dense=True):
        k = _compile(gemm, ptrs, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                      BLOCK_K=cfg.block_k, EVEN_K=True, SWAP_AB=cfg.swap_ab,
                                      ACT_FP8=False, PRESCALE=False, X_Q=False, DENSE=True, RESIDUAL=False),
                     cfg.num_warps, cfg.num_stages,
                     div16=("N", "K", "stride_xm", "stride_om", "stride_os", "stride_rm"))
        report = _ptxas(k)
        assert k.metadata.shared <= SMEM and _spills(k) == 0, cfg
        assert _async_copies(k) >= 2 and "C7515" not in report, (cfg, report[-600:])
        if (cfg.block_n if cfg.swap_ab else cfg.block_m) >= 64:
            assert "warp_group_dot " in k.asm["ttgir"], cfg


def test_sm90_w8a8_residual_epilogue_and_act_quant_compile():
    """The prequantised W8A8 GEMM with the residual in its epilogue (an unsplit launch writes
    bf16 out = r + the product) at w2's shape and 64 rows, in each prequant config: within
    shared memory, no spills, wgmma async; the split reduce with the residual; and the norm
    and gate kernels that quantise in their own launch (engine/kernels/act_quant.py): no
    spills, true divisions (`div.rn`, never div.full.f32: the values quantize_act_torch
    gives)."""
    from engine.kernels import act_quant as aq
    from engine.kernels import fp8_triton as ft

    gemm, reduce_splits, _ = ft._kernels()
    for cfg in [c for c in ft.sweep_configs(64, w8a8=True) if c.prequant]:
        k = _compile(gemm, {"x_ptr": "fp8e4nv", "q_ptr": "fp8e4nv", "s_ptr": "fp32",
                            "out_ptr": "bf16", "xs_ptr": "fp32", "r_ptr": "bf16"},
                     dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          EVEN_K=True, SWAP_AB=cfg.swap_ab, ACT_FP8=True, PRESCALE=False,
                          X_Q=True, DENSE=False, RESIDUAL=True), cfg.num_warps,
                     cfg.num_stages,
                     div16=("N", "K", "stride_xm", "stride_om", "stride_os", "stride_rm"))
        assert k.metadata.shared <= SMEM and _spills(k) == 0, cfg
        assert "C7515" not in _ptxas(k) and "warp_group_dot " in k.asm["ttgir"], cfg
    red = _compile(reduce_splits, {"p_ptr": "fp32", "out_ptr": "bf16", "r_ptr": "bf16"},
                   dict(BLOCK=ft.REDUCE_BLOCK, RESIDUAL=True), 4, 1,
                   div16=("MN", "N", "stride_rm"))
    assert _spills(red) == 0
    norm, glu, _ = aq._kernels()
    kn = _compile(norm, {"h_ptr": "bf16", "w_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
                  dict(ROW=4096, BLOCK=128), 4, 1, div16=("K", "stride_hm"), floats=("eps",))
    kg = _compile(glu, {"a_ptr": "bf16", "b_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
                  dict(BLOCK=128), 1, 1, div16=("K", "stride_am", "stride_bm"))
    for k in (kn, kg):
        assert _spills(k) == 0
        assert "div.full.f32" not in k.asm["ptx"] and "div.rn" in k.asm["ptx"]


@pytest.mark.parametrize("m", [16, 32, 64])
def test_sm90_glu_gemm_compiles_in_the_prequant_tiles(m):
    """The packed w13's W8A8 GEMM with the gate and its quantisation in the epilogue
    (engine/kernels/act_quant.py) in each prequant config with 128-wide N tiles that the
    sweep times at up to m rows, at S2-Pro's shape (I = 9,728, K = 2,560): within shared
    memory (two weight tiles per stage), no spills, both dots through wgmma, true divisions."""
    from engine.kernels import act_quant as aq
    from engine.kernels import fp8_triton as ft

    _, _, glu = aq._kernels()
    cfgs = [c for c in ft.sweep_configs(m, w8a8=True) if c.prequant and c.block_n == 128]
    assert cfgs
    for cfg in cfgs:
        k = _compile(glu, {"x_ptr": "fp8e4nv", "xs_ptr": "fp32", "q_ptr": "fp8e4nv",
                           "s_ptr": "fp32", "oq_ptr": "fp8e4nv", "os_ptr": "fp32"},
                     dict(BLOCK_M=cfg.block_m, BLOCK=128, EVEN_K=True, SWAP_AB=cfg.swap_ab,
                          BF16=True), cfg.num_warps, cfg.num_stages,
                     div16=("NI", "K"))
        assert k.metadata.shared <= SMEM and _spills(k) == 0, (cfg, k.metadata.shared)
        assert k.asm["ttgir"].count("warp_group_dot ") >= 2, cfg
        assert "div.full.f32" not in k.asm["ptx"], cfg
