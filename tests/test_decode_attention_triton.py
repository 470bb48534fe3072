"""engine/kernels/decode_attention_triton.py: the launch contract, the automatic splits, the
kernel against the float32 fallback (`decode_attention_torch`) under Triton's interpreter on
the CPU (TRITON_INTERPRET=1, tests/test_triton_interpreter.py runs these) and on CUDA, and
the wrapper's routing (`decode_attention(..., triton_rows=)`) on CUDA.

Tolerance: q.k^T is exact in float32 and the probabilities are rounded to the cache's dtype
for the p.v product (bf16: 2^-9 relative each), so outputs (|v| ~ 1) may be off by ~1e-2."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import decode_attention as attention
from engine.kernels import decode_attention_triton as tri
from engine.kernels.fp8_triton import _triton_importable
from tests.test_kernels import _attention_case, _rope_case

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and _triton_importable()
CUDA = torch.cuda.is_available() and tri.available()
needs_interp = pytest.mark.skipif(not INTERPRET,
                                  reason="needs TRITON_INTERPRET=1 and triton importable")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")


def _check(case, S, *, splits, config=None, tol=2e-2, out=None):  # type: ignore[no-untyped-def]
    """The kernel's output and cache writes against the fallback's on a copy of the case."""
    q, kn, vn, kc, vc, table, wb, pos = case
    kc2, vc2 = kc.clone(), vc.clone()
    got = tri.decode_attention_triton(q, kn, vn, kc, vc, table, wb, pos, splits=splits,
                                      config=config, out=out)
    want = attention.decode_attention_torch(q, kn, vn, kc2, vc2, table, wb, pos, S)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # position p written, nothing else
    return got


@pytest.mark.parametrize("cfg", [tri.Config(48), tri.Config(8), tri.Config(128),
                                 tri.Config(64, warps=1), tri.Config(64, stages=0)])
def test_config_rejects_bad_shapes(cfg):
    with pytest.raises(ValueError, match="Config"):
        cfg.check(64)


@pytest.mark.parametrize("splits", [-1, 33, 1.5, True])
def test_rejects_bad_splits(splits):
    case = _attention_case(2, 4, 2, 16, 20, torch.bfloat16, "cpu", bs=16)
    with pytest.raises(ValueError, match="splits"):
        tri.decode_attention_triton(*case, splits=splits)


def test_auto_splits_fill_one_wave_in_powers_of_two():
    assert tri.auto_splits(64, 8, 132) == 1  # 512 programs: several waves already
    assert tri.auto_splits(16, 8, 132) == 1  # 128 programs: one wave (splits measured slower)
    assert tri.auto_splits(8, 8, 132) == 2  # 128 programs
    assert tri.auto_splits(2, 8, 132) == 8  # 128 programs
    assert tri.auto_splits(1, 8, 132) == 16
    assert tri.auto_splits(1, 1, 132) == tri.MAX_SPLITS  # at most
    assert tri.auto_splits(0, 8, 132) == tri.MAX_SPLITS  # no rows: the bound, not a loop


@pytest.mark.parametrize("bad", ["q", "k_new", "out", "cache", "pos"])
def test_rejects_layouts_it_does_not_read(bad):
    case = list(_attention_case(2, 4, 2, 16, 20, torch.bfloat16, "cpu", bs=16))
    out = None
    if bad == "q":
        case[0] = case[0].transpose(1, 2).contiguous().transpose(1, 2)  # dims not packed
    elif bad == "k_new":
        case[1] = torch.empty(2, 16, 2, dtype=torch.bfloat16).transpose(1, 2)
    elif bad == "out":
        out = torch.empty(2, 16, 4, dtype=torch.bfloat16).transpose(1, 2)
    elif bad == "cache":
        case[4] = case[4].transpose(2, 3).contiguous().transpose(2, 3)
    else:
        case[7] = torch.stack([case[7], case[7]], 1)[:, 0]  # a strided [B] view
    with pytest.raises(ValueError, match="decode_attention_triton"):
        tri.decode_attention_triton(*case, out=out)


def test_supported_names_the_kernels_shapes():
    assert tri.shapes_supported(32, 8, 128, 64)  # S2-Pro's slow AR, the pool's blocks
    assert tri.shapes_supported(16, 1, 16, 16)
    assert tri.shapes_supported(4, 2, 48, 64)  # the tiny model's (padded to 64)
    assert not tri.shapes_supported(4, 1, 20, 64)  # head_dim not a multiple of 8
    assert not tri.shapes_supported(32, 1, 128, 64)  # 32 query heads per kv head
    assert not tri.shapes_supported(32, 8, 128, 10)  # the fast AR's 10-position blocks
    assert not tri.shapes_supported(32, 8, 512, 64)
    case = _attention_case(2, 32, 8, 128, 70, torch.bfloat16, "cpu", bs=64)
    q, _, _, kc, _, table, wb, pos = case
    assert not tri.supported(q, kc, table, wb, pos)  # CPU tensors


@pytest.mark.parametrize("rows", [-1, True, 1.5])
def test_routing_rejects_bad_rows(rows):
    case = _attention_case(3, 4, 2, 16, 6, torch.float32, "cpu")
    with pytest.raises(ValueError, match="triton_rows must be an int >= 0"):
        attention.decode_attention(*case, span=6, triton_rows=rows)


def test_routing_off_cuda_is_csrcs_contract_unchanged():
    """Off CUDA (and for calls the kernel does not take) `triton_rows` changes nothing."""
    case = _attention_case(3, 4, 2, 16, 12, torch.float32, "cpu")
    again = [t.clone() for t in case]
    got = attention.decode_attention(*case, span=12, triton_rows=1)
    assert torch.equal(got, attention.decode_attention(*again, span=12))
    assert torch.equal(case[3], again[3]) and torch.equal(case[4], again[4])


def test_build_ops_and_engine_config_bound_the_rows():
    from engine.config import EngineConfig
    from engine.ops import build_ops

    with pytest.raises(ValueError, match="attention_triton_rows must be an int >= 0"):
        build_ops("cpu", attention_triton_rows=-1)
    with pytest.raises(ValueError, match="attention_triton_rows"):
        EngineConfig(attention_triton_rows=-1)
    assert build_ops("cpu", attention_triton_rows=16).describe()["attention_triton_rows"] == 0


# the fixture sizes: GQA 2 and 4, head_dim 16 / 64, blocks of 16 and 64, positions crossing
# blocks; row 0 at position 0, the last row writing the scratch block (_attention_case)
INTERP_CASES = [(3, 4, 2, 16, 40, 16), (2, 8, 2, 64, 70, 64), (4, 4, 1, 32, 33, 16),
                (3, 4, 2, 48, 50, 16)]


@needs_interp
@pytest.mark.parametrize("B,H,Hkv,D,S,bs", INTERP_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_interp_kernel_matches_fallback(monkeypatch, B, H, Hkv, D, S, bs, splits):
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    case = _attention_case(B, H, Hkv, D, S, torch.bfloat16, "cpu", bs=bs, last_at_end=True)
    _check(case, S, splits=splits, config=tri.Config(16, 4, 1))


@needs_interp
def test_interp_kernel_writes_a_strided_out_and_merges_empty_splits(monkeypatch):
    """Rows of `out` further apart than H * D (one position of a [B, T, H, D] output), and
    more splits than a short row has tiles (its later ranges empty, merged as nothing)."""
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    case = _attention_case(3, 4, 2, 16, 20, torch.bfloat16, "cpu", bs=16)
    wide = torch.full((3, 2, 4, 16), 7.0, dtype=torch.bfloat16)
    got = _check(case, 20, splits=8, config=tri.Config(16, 4, 1), out=wide[:, 0])
    assert got.data_ptr() == wide.data_ptr()
    assert torch.equal(wide[:, 1], torch.full((3, 4, 16), 7.0, dtype=torch.bfloat16))


@needs_interp
def test_interp_one_row_takes_its_block_ids_with_any_stride(monkeypatch):
    """One row: its write block and position are [1] tensors, which torch calls contiguous
    with any stride (a column of the table: `table[:, j].contiguous()` keeps the table's row
    stride); the wrapper takes them (the kernel_bench's one-row case had failed there)."""
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    q, kn, vn, kc, vc, table, _, pos = _attention_case(1, 4, 2, 16, 40, torch.bfloat16, "cpu",
                                                       bs=16, last_at_end=True)
    wb = table[:, int(pos[0]) // 16].contiguous()
    assert wb.stride(0) == table.shape[1] > 1
    _check((q, kn, vn, kc, vc, table, wb, pos), 40, splits=1, config=tri.Config(16, 4, 1))


def _rope_check(case, S, rope, *, splits, config=None, tol=2**-7):  # type: ignore[no-untyped-def]
    """The kernel with the fused q/k norm + RoPE against functional.norm_rope_qk and then
    the fallback: the stored keys to a bf16 ulp (only the sum of squares' order differs),
    the values untouched, the output within the kernel's tolerance."""
    q, kn, vn, kc, vc, table, wb, pos = case
    kc2, vc2 = kc.clone(), vc.clone()
    got = tri.decode_attention_triton(q, kn, vn, kc, vc, table, wb, pos, splits=splits,
                                      config=config, cs=rope.cs, qw=rope.qw, kw=rope.kw,
                                      eps=rope.eps)
    q2, k2 = attention.apply_rope(q, kn, rope)
    want = attention.decode_attention_torch(q2, k2, vn, kc2, vc2, table, wb, pos, S)
    torch.testing.assert_close(kc.float(), kc2.float(), rtol=tol, atol=tol)
    assert float((kc != kc2).float().mean()) < 2e-3 and torch.equal(vc, vc2)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_rope_arguments_are_checked():
    case = _attention_case(2, 4, 2, 16, 20, torch.bfloat16, "cpu", bs=16)
    rope = _rope_case(2, 16, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="qw and kw together"):
        tri.decode_attention_triton(*case, qw=rope.qw, kw=rope.kw)  # no cs
    with pytest.raises(ValueError, match="cs"):
        tri.decode_attention_triton(*case, cs=rope.cs.transpose(1, 2))
    with pytest.raises(ValueError, match="qw must be"):
        tri.decode_attention_triton(*case, cs=rope.cs, qw=rope.qw[:8], kw=rope.kw, eps=1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        tri.decode_attention_triton(*case, cs=rope.cs, qw=rope.qw, kw=rope.kw)


@needs_interp
@pytest.mark.parametrize("norm,shared", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("D", [16, 48])
def test_interp_fused_norm_rope(monkeypatch, norm, shared, D):
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    case = _attention_case(3, 4, 2, D, 40, torch.bfloat16, "cpu", bs=16, last_at_end=True)
    rope = _rope_case(3, D, torch.bfloat16, "cpu", norm=norm, shared=shared)
    _rope_check(case, 40, rope, splits=2, config=tri.Config(16, 4, 1))


@needs_cuda
@pytest.mark.parametrize("norm,shared", [(True, False), (False, True)])
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 32, 8, 128, 300), (2, 32, 8, 128, 1024),
                                         (64, 32, 8, 128, 300), (3, 4, 2, 48, 130)])
@pytest.mark.parametrize("splits", [0, 1])
def test_cuda_fused_norm_rope(norm, shared, B, H, Hkv, D, S, splits):
    case = _attention_case(B, H, Hkv, D, S, torch.bfloat16, "cuda", bs=64, last_at_end=True)
    rope = _rope_case(B, D, torch.bfloat16, "cuda", norm=norm, shared=shared)
    _rope_check(case, S, rope, splits=splits)


@needs_cuda
@pytest.mark.parametrize("B,H,Hkv,D,S", [(64, 32, 8, 128, 300), (16, 32, 8, 128, 1024),
                                         (256, 32, 8, 128, 700), (3, 4, 2, 64, 17),
                                         (5, 16, 1, 128, 130), (5, 4, 2, 48, 130)])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_cuda_kernel_matches_fallback(B, H, Hkv, D, S, splits):
    """bf16 at S2-Pro's and odd shapes, each split choice (each a compiled variant: the
    launch shapes and fp16 below take fewer cases)."""
    _check(_attention_case(B, H, Hkv, D, S, torch.bfloat16, "cuda", bs=64, last_at_end=True),
           S, splits=splits)


@needs_cuda
@pytest.mark.parametrize("cfg", [tri.Config(32, 4, 2), tri.Config(64, 8, 4), tri.Config(64, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_launch_shapes_and_fp16(cfg, dtype):
    for splits in (1, 3):
        _check(_attention_case(64, 32, 8, 128, 300, dtype, "cuda", bs=64, last_at_end=True),
               300, splits=splits, config=cfg)


@needs_cuda
def test_cuda_routing_by_rows_and_graph_capture():
    """`decode_attention(..., triton_rows=R)` runs this kernel from R rows (csrc's below it),
    and the call replays in a CUDA graph."""
    for B, want_triton in ((8, False), (16, True)):
        case = _attention_case(B, 32, 8, 128, 200, torch.bfloat16, "cuda", bs=64,
                               last_at_end=True)
        q, kn, vn, kc, vc, table, wb, pos = case
        got = attention.decode_attention(q, kn, vn, kc.clone(), vc.clone(), table, wb, pos,
                                         200, triton_rows=16)
        ref_tri = tri.decode_attention_triton(q, kn, vn, kc.clone(), vc.clone(), table, wb,
                                              pos)
        assert torch.equal(got, ref_tri) == want_triton
    # with the fused q/k norm + RoPE: routed with it into the Triton kernel's launch
    rope = _rope_case(16, 128, torch.bfloat16, "cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.decode_attention(q, kn, vn, kc2, vc2, table, wb, pos, 200, rope=rope,
                                     triton_rows=16)
    kc3, vc3 = kc.clone(), vc.clone()
    direct = tri.decode_attention_triton(q, kn, vn, kc3, vc3, table, wb, pos, cs=rope.cs,
                                         qw=rope.qw, kw=rope.kw, eps=rope.eps)
    assert torch.equal(got, direct) and torch.equal(kc2, kc3)
    out = torch.empty_like(q)
    g = torch.cuda.CUDAGraph()
    attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, 200, triton_rows=16,
                               out=out)  # compiled before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, 200, triton_rows=16,
                                   out=out)
    _replay_matches(g, out, (q, kn, vn, kc, vc, table, wb, pos), 200)


def _replay_matches(g, out, case, span):  # type: ignore[no-untyped-def]
    """Replay graph g, whose attention writes `out`, and check it against the fallback."""
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    q, kn, vn, kc, vc, table, wb, pos = case
    want = attention.decode_attention_torch(q, kn, vn, kc.clone(), vc.clone(), table, wb, pos,
                                            span)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- shared prefixes (cascade)
def _shared_case(B, H, Hkv, D, S, bs, groups, n_blocks, *, device="cpu",  # type: ignore[no-untyped-def]
                 dtype=torch.bfloat16, seed=0):
    """_attention_case with the rows of each group in `groups` (lists of rows) reading the
    first `n_blocks` blocks of the group's first row (one stored voice's prompt), each row
    past them at its own position in a block of its own."""
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(B, H, Hkv, D, S, dtype, "cpu",
                                                        seed=seed, bs=bs)
    g = torch.Generator().manual_seed(seed + 1)
    for rows in groups:
        for r in rows:
            table[r, :n_blocks] = table[rows[0], :n_blocks]
            pos[r] = int(torch.randint(n_blocks * bs, S, (1,), generator=g))
            wb[r] = table[r, pos[r] // bs]
    case = [t.to(device) for t in (q, kn, vn, kc, vc, table, wb, pos)]
    # k_new as the model hands it over, a view into a wider row (`.to` made it dense)
    wide = torch.empty(kn.shape[0], kn.stride(0), dtype=kn.dtype, device=device)
    case[1] = wide.as_strided(kn.shape, kn.stride()).copy_(case[1])
    return case


def _prefix_tiles(table, bs, rows_per_tile, device, max_groups=2):  # type: ignore[no-untyped-def]
    """The runner's plan (engine/shared_prefix.py) of a case's tables, on `device`."""
    from engine.shared_prefix import SharedPrefixes

    sp = SharedPrefixes(table.shape[0], bs, rows_per_tile, device, max_groups=max_groups)
    for r, blocks in enumerate(table.tolist()):
        sp.set(r, blocks)
    sp.refresh()
    return sp


def _check_shared(case, S, *, splits, rows_per_tile, config=None, tol=2e-2, prefix=None):  # type: ignore[no-untyped-def]
    q, kn, vn, kc, vc, table, wb, pos = case
    sp = None
    if prefix is None:
        sp = _prefix_tiles(table.cpu(), kc.shape[2], rows_per_tile, q.device)
        prefix = sp.tiles
    kc2, vc2 = kc.clone(), vc.clone()
    got = tri.decode_attention_triton(q, kn, vn, kc, vc, table, wb, pos, splits=splits,
                                      config=config, prefix=prefix)
    want = attention.decode_attention_torch(q, kn, vn, kc2, vc2, table, wb, pos, S)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    return sp


def test_plan_groups_rows_by_their_common_leading_blocks():
    from engine.shared_prefix import plan

    tables = [[5, 6, 7, 40], [5, 6, 7, 41], [], [9, 1], [5, 6, 8, 42], [5, 6, 7, 43],
              [9, 2], [3, 4]]
    tiles, start = plan(tables, 16, rows_per_tile=2, max_tiles=8)
    # rows 0, 1, 4, 5 share blocks 5, 6 (row 4 parts at the third); rows 3, 6 block 9
    assert tiles == [([0, 1], 32, 0), ([4, 5], 32, 4), ([3, 6], 16, 3)]
    assert start == [32, 32, 0, 16, 32, 32, 16, 0]
    # a lone row left over reads its prefix itself; max_tiles bounds the plan
    tiles, start = plan(tables, 16, rows_per_tile=3, max_tiles=8)
    assert tiles == [([0, 1, 4], 32, 0), ([3, 6], 16, 3)] and start[5] == 0
    tiles, start = plan(tables, 16, rows_per_tile=2, max_tiles=1)
    assert tiles == [([0, 1], 32, 0)] and start == [32, 32, 0, 0, 0, 0, 0, 0]
    assert plan(tables, 16, rows_per_tile=2, max_tiles=8, min_blocks=2)[0] == [
        ([0, 1], 32, 0), ([4, 5], 32, 4)]
    assert plan([[1], [2], []], 64, 16, 4) == ([], [0, 0, 0])
    with pytest.raises(ValueError, match="rows_per_tile"):
        plan(tables, 16, rows_per_tile=0, max_tiles=8)


def test_shared_prefixes_follow_the_row_ops_into_one_device_buffer():
    from engine.shared_prefix import SharedPrefixes

    sp = SharedPrefixes(5, 16, 2, "cpu", max_groups=1)
    assert sp.max_tiles == 4 and sp.tiles.rows.shape == (4, 2) and sp.tiles.start.shape == (5,)
    sp.set(0, [1, 2, 3])
    sp.set(3, [1, 2, 4])
    sp.refresh()
    assert not sp.dirty and sp.n_tiles == 1
    assert sp.tiles.rows.tolist() == [[0, 3], [-1, -1], [-1, -1], [-1, -1]]
    assert sp.tiles.length.tolist() == [32, 0, 0, 0] and sp.tiles.src.tolist()[0] == 0
    assert sp.tiles.start.tolist() == [32, 0, 0, 32, 0]
    sp.extend(3, 5, [7])  # entries 3, 4 skipped: they match no other row's
    assert not sp.dirty  # appended past row 3's shared run: the plan stands
    sp.extend(0, 2, [9, 10])  # a rewrite of row 0's third entry
    assert sp.dirty
    assert sp.tables[3] == [1, 2, 4, -5, -5, 7] and sp.tables[0] == [1, 2, 9, 10]
    sp.clear(3)
    sp.refresh()
    assert sp.n_tiles == 0 and sp.tiles.start.tolist() == [0] * 5
    assert sp.tiles.length.tolist() == [0] * 4
    # a row whose blocks all lie in the shared run bounds it: its extend plans again
    sp.set(1, [1])
    sp.refresh()
    assert sp.tiles.start.tolist()[:2] == [16, 16]
    sp.extend(1, 1, [2])
    assert sp.dirty
    sp.refresh()
    assert sp.tiles.start.tolist()[:2] == [32, 32]


def test_prefix_layouts_are_checked():
    case = _shared_case(4, 4, 2, 16, 40, 16, [[0, 1, 2]], 1)
    sp = _prefix_tiles(case[5], 16, 2, "cpu")
    bad = [sp.tiles._replace(rows=sp.tiles.rows.long()),
           sp.tiles._replace(length=sp.tiles.length[:-1]),
           sp.tiles._replace(start=sp.tiles.start[:2]),
           sp.tiles._replace(rows=torch.zeros(2, 65, dtype=torch.int32))]  # 130 queries
    for prefix in bad:
        with pytest.raises(ValueError, match="prefix"):
            tri.decode_attention_triton(*case, prefix=prefix)
    rope = _rope_case(4, 16, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="rotated"):
        tri.decode_attention_triton(*case, prefix=sp.tiles, cs=rope.cs)
    with pytest.raises(ValueError, match="prefix_warps"):
        tri.decode_attention_triton(*case, prefix=sp.tiles, prefix_warps=3)


@needs_interp
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("H,Hkv,D,bs", [(4, 2, 16, 16), (8, 2, 48, 32)])
def test_interp_shared_prefix_matches_fallback(monkeypatch, splits, H, Hkv, D, bs):
    """Two groups of rows sharing 2 blocks and 1 block (tiles of 2 rows: one group cut in
    two and a lone row left over), rows of no group, more splits than short rows fill."""
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    case = _shared_case(8, H, Hkv, D, 3 * bs + 5, bs, [[0, 2, 3, 5, 7], [1, 4]], 2)
    sp = _check_shared(case, 3 * bs + 5, splits=splits, rows_per_tile=2,
                       config=tri.Config(16, 4, 1))
    assert sp.n_tiles == 3 and sorted(sp.tiles.start.tolist()) == [0, 0] + [2 * bs] * 6


@needs_interp
def test_interp_shared_prefix_never_reads_past_a_rows_position(monkeypatch):
    """A plan that claims more than a row has written (its position inside the shared
    blocks; it writes to the scratch block) still gives the row its positions 0..pos only;
    a tile's rows past the call's (row >= B) are skipped, and a tile of such rows only."""
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    q, kn, vn, kc, vc, table, wb, pos = _shared_case(4, 4, 2, 16, 60, 16, [[0, 1, 2, 3]], 3)
    pos[2], wb[2] = 5, kc.shape[0] - 1  # inside the first shared block
    sp = _prefix_tiles(table, 16, 4, "cpu")
    assert sp.tiles.length.tolist()[0] == 48
    case = (q, kn, vn, kc, vc, table, wb, pos)
    _check_shared(case, 60, splits=2, rows_per_tile=4, config=tri.Config(16, 4, 1),
                  prefix=sp.tiles)
    # the first two rows called alone, with the same (4-row) plan
    part = (q[:2], kn[:2], vn[:2], kc, vc, table[:2], wb[:2], pos[:2])
    _check_shared(part, 60, splits=1, rows_per_tile=4, config=tri.Config(16, 4, 1),
                  prefix=sp.tiles)
    # a tile whose rows are all past the call's (its table row is not even read: the
    # call's table has B rows)
    q, kn, vn, kc, vc, table, wb, pos = _shared_case(4, 4, 2, 16, 60, 16, [[2, 3]], 2)
    sp = _prefix_tiles(table, 16, 4, "cpu")
    assert sp.n_tiles == 1 and sp.tiles.src.tolist()[0] == 2
    part = (q[:2], kn[:2], vn[:2], kc, vc, table[:2].clone(), wb[:2], pos[:2])
    _check_shared(part, 60, splits=2, rows_per_tile=4, config=tri.Config(16, 4, 1),
                  prefix=sp.tiles)


@needs_cuda
@pytest.mark.parametrize("B,S,groups", [(64, 600, [list(range(64))]),
                                        (48, 700, [list(range(0, 48, 2)), [1, 3, 5]]),
                                        (256, 500, [list(range(200))])])
@pytest.mark.parametrize("splits", [0, 1])
def test_cuda_shared_prefix_matches_fallback(B, S, groups, splits):
    """S2-Pro's slow AR with a 10 s voice's ~215 positions shared (4 blocks of 64)."""
    from engine.kernels.decode_attention_triton import prefix_rows_per_tile

    case = _shared_case(B, 32, 8, 128, S, 64, groups, 4, device="cuda")
    _check_shared(case, S, splits=splits, rows_per_tile=prefix_rows_per_tile(32, 8))


@needs_cuda
def test_cuda_shared_prefix_replays_in_a_graph_after_a_new_plan():
    """The plan's buffer is read at replay: a graph captured with no sharing gives the
    shared rows' attention once the plan changes (staged, no recapture)."""
    from engine.shared_prefix import SharedPrefixes

    q, kn, vn, kc, vc, table, wb, pos = _shared_case(64, 32, 8, 128, 400, 64,
                                                     [list(range(64))], 3, device="cuda")
    sp = SharedPrefixes(64, 64, 16, "cuda")
    sp.refresh()
    out = torch.empty_like(q)

    def call():  # type: ignore[no-untyped-def]
        attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, 400, triton_rows=16,
                                   out=out, prefix=sp.tiles)

    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for r, blocks in enumerate(table.tolist()):
        sp.set(r, blocks)
    sp.refresh()
    assert sp.n_tiles == 4
    _replay_matches(g, out, (q, kn, vn, kc, vc, table, wb, pos), 400)


@needs_interp
def test_interp_engine_plans_match_every_rows_attention(monkeypatch):
    """The real engine (tiny model, bf16, CPU) with shared prefixes on: five sessions on one
    voice speak two turns each (four rows: one waits) while its scheduler shares the voice's blocks, copies their
    last one on write, grows tables and frees rows. At every slow-AR decode attention the
    runner plans, the cascade (the Triton programs, interpreted) equals every row's own
    attention (the float32 fallback), and some plans did share."""
    import dataclasses
    import functools

    from engine.config import EngineConfig
    from engine.engine import CollectingSink, build_engine
    from engine.loader import load_bundle
    from engine.ops import build_ops
    from engine.runner import ModelRunner
    from engine.sampler import SamplingParams
    from tests.test_fp8_triton import _patch_interpreter

    _patch_interpreter(monkeypatch)
    monkeypatch.setattr(tri, "auto_splits", lambda *a: 1)  # few programs to interpret
    shared_calls = []

    def kernel(q, kn, vn, kc, vc, table, wb, pos, span, *, rope=None, prefix=None, **_):  # type: ignore[no-untyped-def]
        if prefix is not None:  # the cascade on copies, against the fallback below
            got = tri.decode_attention_triton(q, kn, vn, kc.clone(), vc.clone(), table, wb,
                                              pos, prefix=prefix, config=tri.Config(16, 4, 1),
                                              splits=1)
        want = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span,
                                          kernel=False, rope=rope)
        if prefix is not None:  # outputs ~0.2-0.7 here: a bf16 ulp or two apart at most
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=4e-3)
            shared_calls.append(int((prefix.length > 0).sum()))
        return want

    bundle = load_bundle("tiny", device="cpu", dtype="bf16")
    slow = bundle.model.cfg.slow
    monkeypatch.setattr(ModelRunner, "_attention_kernel",
                        lambda self, c: kernel if c is slow else None)
    ops = dataclasses.replace(build_ops("cpu", fused="reference"),
                              decode_attention=functools.partial(kernel, triton_rows=2),
                              shared_prefix=True)
    eng = build_engine(bundle, EngineConfig(max_running=4, max_len=256, pingpong=False,
                                            kv_block_size=16), ops=ops)
    sinks = [CollectingSink() for _ in range(5)]
    seqs = [eng.open([], SamplingParams(seed=i), s) for i, s in enumerate(sinks)]
    eng.run_until_idle()
    for rnd in range(2):
        for i, seq in enumerate(seqs):
            # texts that differ from their first token on: a row's own positions right
            # after the shared blocks differ from every other row's
            eng.submit(seq, f"{'ABCDE'[i]} says round {rnd}.", turn_id=f"{rnd}",
                       max_frames=3 + i)
        eng.run_until_idle()
    assert all(len(s.results) == 2 and not s.errors for s in sinks)
    assert eng.stats["prefix_hits"] >= 4 and eng.stats["cow_copies"] >= 1
    assert shared_calls and max(shared_calls) >= 1
