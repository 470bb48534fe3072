"""csrc kernels: the contract of each wrapper, the fallback's semantics, and (on CUDA) that
the kernel and the fallback agree."""

from __future__ import annotations

import shutil

import pytest
import torch
from _codec_stream import stream_vs_offline, unit_block

from engine import functional
from engine.kernels import activation, extension_available, linear, prev_tokens, sampling
from engine.kernels import codec_conv as cc
from engine.kernels import decode_attention as attention


def _reference_shift(prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    return torch.cat([prev[:, 1:], nxt[:, None]], dim=1)


def test_prev_tokens_shift_fallback_semantics():
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, 4096, (5, 10, 10), dtype=torch.int32, generator=g)
    nxt = torch.randint(0, 4096, (5, 10), dtype=torch.int32, generator=g)
    want = _reference_shift(prev, nxt)
    prev_tokens.prev_tokens_shift_inplace(prev, nxt)
    assert torch.equal(prev, want)


@pytest.mark.parametrize("prev,nxt,err", [
    (torch.zeros(2, 4, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32), TypeError),
    (torch.zeros(2, 4, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int64), TypeError),
    (torch.zeros(2, 12, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), ValueError),
    (torch.zeros(2, 4, 3, dtype=torch.int32), torch.zeros(3, 3, dtype=torch.int32), ValueError),
    (torch.zeros(2, 4, 3, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), ValueError),
    (torch.zeros(2, 3, 4, dtype=torch.int32).transpose(1, 2), torch.zeros(2, 3, dtype=torch.int32),
     ValueError),
])
def test_prev_tokens_shift_contract(prev, nxt, err):
    with pytest.raises(err):
        prev_tokens.prev_tokens_shift_inplace(prev, nxt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prev_tokens_shift_cuda_kernel_matches_fallback():
    assert extension_available(), "the CUDA extension did not build"
    for bs, W, cw in ((1, 10, 10), (64, 16, 10), (129, 10, 1), (3, 1, 7)):
        prev = torch.randint(0, 4096, (bs, W, cw), dtype=torch.int32, device="cuda")
        nxt = torch.randint(0, 4096, (bs, cw), dtype=torch.int32, device="cuda")
        want = _reference_shift(prev, nxt)
        prev_tokens.prev_tokens_shift_inplace(prev, nxt)
        assert torch.equal(prev, want)


# ---------------------------------------------------------------------- step bookkeeping
def _book_case(B: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Inputs of the three bookkeeping functions for B rows: logits rows strided (a slice of a
    wider buffer), h a strided view, next_col a view of a wider state (as the runner's)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g).to(device)

    def i(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g).to(device)

    temperature = r(B)
    temperature[::3] = 0.0  # greedy rows: their RAS draw stays greedy
    return {
        "logits": torch.randn(B, 40, generator=g).to(dtype).to(device)[:, 3:36],
        "sampling": [temperature, r(B), r(B), r(B), i(1, 30, B), i(0, 2**40, B), i(0, 9, B)],
        "idx": i(0, 9, B),  # 8 semantic codes and <|im_end|>
        "table": torch.randn(12, 64, generator=g).to(dtype).to(device),
        "h": torch.randn(B, 3, 64, generator=g).to(dtype).to(device)[:, 1],
        "columns": [c.contiguous() for c in i(0, 12, B, 11).unbind(1)],  # as the draws give
        "state": [r(B) < 0.7, i(0, 20, B + 1, 11)[:B], i(0, 500, B), i(0, 3, B), r(B) < 0.7,
                  i(0, 9, B)],
    }


@pytest.mark.parametrize("B", [1, 3])
def test_step_book_wrappers_run_the_reference_off_cuda(B):
    """On the CPU (or with kernel=False) the wrappers are engine/bookkeeping.py's functions."""
    from engine import bookkeeping as ref
    from engine.kernels import step_book

    c, d = _book_case(B, "cpu", torch.float32), _book_case(B, "cpu", torch.float32)
    for x, y in zip(step_book.ras_inputs(c["logits"], *c["sampling"]),
                    ref.ras_inputs(d["logits"], *d["sampling"])):
        assert torch.equal(x, y)
    for x, y in zip(step_book.frame_tokens(c["idx"], 8, 100, 9, c["table"], c["h"]),
                    ref.frame_tokens(d["idx"], 8, 100, 9, d["table"], d["h"])):
        assert torch.equal(x, y)
    assert torch.equal(step_book.step_end(c["columns"], *c["state"], 9),
                       ref.step_end(d["columns"], *d["state"], 9))
    assert all(torch.equal(x, y) for x, y in zip(c["state"], d["state"]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B", [1, 2, 5, 129, 257])
def test_step_book_cuda_kernels_are_the_reference_bit_for_bit(dtype, B):
    """csrc/bookkeeping.cu against the torch functions: every output and every in-place
    update equal, strided inputs included, in a CUDA graph too."""
    from engine import bookkeeping as ref
    from engine.kernels import step_book

    assert extension_available(), "the CUDA extension did not build"
    c, d = _book_case(B, "cuda", dtype, B), _book_case(B, "cuda", dtype, B)
    assert step_book.ras_inputs_takes(c["logits"], *c["sampling"])  # the kernels run
    assert step_book.frame_tokens_takes(c["idx"], c["table"], c["h"])
    assert step_book.step_end_takes(c["columns"], *c["state"])
    got = step_book.ras_inputs(c["logits"], *c["sampling"])
    for x, y in zip(got, ref.ras_inputs(d["logits"], *d["sampling"])):
        assert x.dtype == y.dtype and torch.equal(x, y)
    got = step_book.frame_tokens(c["idx"], 8, 100, 9, c["table"], c["h"])
    for x, y in zip(got, ref.frame_tokens(d["idx"], 8, 100, 9, d["table"], d["h"])):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    for _ in range(3):  # rows stop on <|im_end|> (9) or their budget across calls
        out = step_book.step_end(c["columns"], *c["state"], 9)
        want = ref.step_end(d["columns"], *d["state"], 9)
        assert torch.equal(out, want)
        assert all(torch.equal(x, y) for x, y in zip(c["state"], d["state"]))
        c["state"][0].copy_(c["state"][4])  # was <- active, as the next step_begin
        d["state"][0].copy_(d["state"][4])
    # captured and replayed: the same updates
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step_book.step_end(c["columns"], *c["state"], 9)
    torch.cuda.current_stream().wait_stream(s)
    ref.step_end(d["columns"], *d["state"], 9)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step_book.step_end(c["columns"], *c["state"], 9)
    graph.replay()
    want = ref.step_end(d["columns"], *d["state"], 9)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert all(torch.equal(x, y) for x, y in zip(c["state"], d["state"]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ops_reject_bad_inputs_naming_their_shapes():
    """The ops' own checks (the wrappers check or fall back before them): a clear error each,
    shapes and counts printed. Built by a compiler that linked a static libstdc++ (the
    device image's CXX), every message with a number in it crashed the process instead:
    the build takes a compiler that links the shared one (engine/kernels/toolchain.py)."""
    assert extension_available(), "the CUDA extension did not build"
    from engine.kernels import toolchain
    from engine.kernels.build import extension_path

    assert toolchain.links_shared_cxx_runtime(extension_path())
    ops = torch.ops.rtvoice_kernels
    x3 = torch.zeros(1, 4, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"snake: alpha must be contiguous \[C\] with C = 4, "
                                           r"got \[5\]"):
        ops.snake(x3, torch.zeros(5, device="cuda", dtype=torch.bfloat16), None, x3)
    with pytest.raises(RuntimeError, match=r"prev must be \[bs, W, cw\], got \[2, 4\]"):
        ops.prev_tokens_shift_inplace(torch.zeros(2, 4, dtype=torch.int32, device="cuda"),
                                      torch.zeros(2, 1, dtype=torch.int32, device="cuda"))
    c = _book_case(2, "cuda", torch.bfloat16)
    was, next_col, pos, left, active, draw_step = c["state"]
    out = torch.empty(2, 13, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="a column must be"):
        ops.book_step_end([t.int() for t in c["columns"]], was, next_col, pos, left, active,
                          draw_step, 9, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.book_step_end(c["columns"], was, next_col, pos, left, active, draw_step, 9,
                          out[:, :12])
    x = torch.empty(2, 2, 64, dtype=torch.float32, device="cuda")
    code = torch.empty(2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=r"x must be .*, got \[2, 2, 64\]"):
        ops.book_frame_tokens(c["idx"][:2], c["table"], c["h"], 8, 100, 9, code.clone(), code, x)
    # the wrapper takes a float32 table with bf16 h to the reference (which promotes)
    from engine import bookkeeping as ref
    from engine.kernels import step_book
    for x, y in zip(step_book.frame_tokens(c["idx"][:2], 8, 100, 9, c["table"].float(), c["h"]),
                    ref.frame_tokens(c["idx"][:2], 8, 100, 9, c["table"].float(), c["h"])):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------- decode attention
def _attention_case(B, H, Hkv, D, S, dtype, device, seed=0, strided_v=True, bs=16,
                    last_at_end=False):
    """A paged case: each row's S positions in blocks of `bs`, scattered over a shuffled
    pool (plus a scratch block, the last); the last row (B > 1) writes to the scratch block
    like a padding row; `last_at_end`: the last row at position S - 1 (the longest read).
    Returns q, k_new, v_new, k_cache, v_cache, table, wblock, pos."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q = r(B, H, D)
    # k/v as the model hands them over: views into a wider projection row (strided rows)
    kv = r(B, 3 * Hkv * D)
    k_new = kv[:, : Hkv * D].view(B, Hkv, D)
    v_new = kv[:, 2 * Hkv * D:].view(B, Hkv, D) if strided_v else r(B, Hkv, D)
    mb = -(-S // bs)
    n = B * mb + 1
    k_cache, v_cache = r(n, Hkv, bs, D), r(n, Hkv, bs, D)
    table = torch.randperm(n - 1, generator=g)[: B * mb].view(B, mb).to(device)
    pos = torch.randint(0, S, (B,), generator=g).to(device)
    if last_at_end:  # before wblock: a row writes into its own block at its position
        pos[-1] = S - 1
    wblock = table[torch.arange(B, device=device), pos // bs].clone()
    if B > 1:
        pos[0], wblock[-1] = 0, n - 1  # a row at position 0; a row writing to the scratch block
        wblock[0] = table[0, 0]
    return q, k_new, v_new, k_cache, v_cache, table, wblock, pos


def _sdpa_reference(q, k_new, v_new, k_cache, v_cache, table, wblock, pos, span):
    """What the decode attend's torch path computes: write, then SDPA on each row's
    positions laid out densely from its blocks."""
    from engine.model import gqa_attention

    bs = k_cache.shape[2]
    k_cache[wblock, :, pos % bs] = k_new
    v_cache[wblock, :, pos % bs] = v_new
    B = q.shape[0]
    keys = torch.stack([torch.cat([k_cache[blk] for blk in table[b].tolist()], 1)[:, :span]
                        for b in range(B)])  # [B, Hkv, span, D]
    vals = torch.stack([torch.cat([v_cache[blk] for blk in table[b].tolist()], 1)[:, :span]
                        for b in range(B)])
    rows = torch.arange(B)
    keys[rows, :, pos] = k_new  # the row's own position comes from k_new
    vals[rows, :, pos] = v_new
    mask = (torch.arange(span)[None, :] <= pos[:, None])[:, None, None, :]
    return gqa_attention(q[:, :, None].float(), keys.float(), vals.float(), mask)[:, :, 0]


@pytest.mark.parametrize("bs", [4, 5, 12, 16])  # blocks smaller than, not dividing, = the span
def test_decode_attention_fallback_matches_sdpa(bs):
    case = _attention_case(5, 8, 2, 16, 12, torch.float32, "cpu", bs=bs)
    q, kn, vn, kc, vc, table, wb, pos = case
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=12)
    want = _sdpa_reference(q, kn, vn, kc2, vc2, table, wb, pos, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same cache writes


def test_decode_attention_dense_cache_is_one_block_per_row():
    """A dense [N, Hkv, S, D] cache (the fast AR's) is the paged case table[b] = [b]."""
    q, kn, vn, kc, vc, table, _, pos = _attention_case(3, 4, 2, 16, 10, torch.float32, "cpu",
                                                       bs=10)
    dense_table = torch.arange(3)[:, None]
    kd, vd = kc[table[:, 0]].clone(), vc[table[:, 0]].clone()  # row b's block as slot b
    got = attention.decode_attention(q, kn, vn, kd, vd, dense_table, torch.arange(3), pos,
                                     span=10)
    want = attention.decode_attention(q, kn, vn, kc, vc, table, table[:, 0].clone(), pos,
                                      span=10)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mutate,err", [
    (lambda a: a.__setitem__(0, a[0].transpose(1, 2)), ValueError),  # q dims not packed
    (lambda a: a.__setitem__(7, a[7].int()), TypeError),  # int32 positions
    (lambda a: a.__setitem__(3, a[3][:, :, :, :8]), ValueError),  # cache head_dim mismatch
    (lambda a: a.__setitem__(1, a[1].double()), TypeError),  # mixed dtypes
    (lambda a: a.__setitem__(5, a[5][:2]), TypeError),  # a table row per batch row
    (lambda a: a.__setitem__(5, a[5].t().contiguous().t()), TypeError),  # table rows not packed
    (lambda a: a.__setitem__(6, a[6][:, None]), TypeError),  # wblock must be [B]
])
def test_decode_attention_contract(mutate, err):
    args = list(_attention_case(3, 4, 2, 16, 6, torch.float32, "cpu", bs=2))
    mutate(args)
    with pytest.raises(err):
        attention.decode_attention(*args, span=6)


@pytest.mark.parametrize("splits", [-1, 1.5, True, "2"])
def test_decode_attention_rejects_bad_splits(splits):
    args = _attention_case(3, 4, 2, 16, 6, torch.float32, "cpu")
    with pytest.raises(ValueError, match="splits must be an int >= 0"):
        attention.decode_attention(*args, span=6, splits=splits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
# (34, 32, 8, 128): 272 kv groups fill the H200 twice, so blocks hold all 4 heads (R = 4)
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 32, 8, 128, 2048), (2, 32, 8, 128, 300),
                                         (34, 32, 8, 128, 256), (3, 4, 2, 48, 17),
                                         (4, 4, 1, 40, 130)])
@pytest.mark.parametrize("splits", [0, 2, 7, 32])  # 0: automatic; 32 > positions: empty ranges
def test_decode_attention_split_positions_match_fallback(dtype, tol, B, H, Hkv, D, S, splits):
    """Rows' positions split over several blocks and merged (small batches, long contexts)
    give the one-block result; the new k/v is written once."""
    assert extension_available(), "the CUDA extension did not build"
    # the longest read (last row); _attention_case puts row 0 at position 0 when B > 1
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(B, H, Hkv, D, S, dtype, "cuda", bs=64,
                                                        last_at_end=True)
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=S, splits=splits)
    want = attention.decode_attention_torch(q, kn, vn, kc2, vc2, table, wb, pos, S)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
# 16 lanes per position at head_dim 128 (one kv group per block at batch 64, R = 4 or 2; one
# head per block at batch 1), 8 lanes otherwise (64, 48, 40)
@pytest.mark.parametrize("B,H,Hkv,D,S", [(1, 32, 8, 128, 2048), (64, 32, 8, 128, 300),
                                         (64, 16, 8, 128, 300), (64, 16, 8, 64, 300),
                                         (3, 4, 2, 48, 17), (5, 4, 1, 40, 10)])
@pytest.mark.parametrize("bs", [10, 16, 64])  # the fast AR's 10; the pool's power of two
def test_decode_attention_cuda_kernel_matches_fallback(dtype, tol, B, H, Hkv, D, S, bs):
    assert extension_available(), "the CUDA extension did not build"
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(B, H, Hkv, D, S, dtype, "cuda", bs=bs,
                                                        last_at_end=True)  # the longest read
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=S)
    want = attention.decode_attention_torch(q, kn, vn, kc2, vc2, table, wb, pos, S)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_decode_attention_writes_a_given_out_with_strided_rows():
    """`out`: one position's [B, H, D] slice of a [B, T, H, D] output (rows strided) gets
    the result, the other positions untouched; an out of another shape, dtype or layout is
    refused by name."""
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(3, 4, 2, 16, 20, torch.float32, "cpu")
    want = attention.decode_attention(q, kn, vn, kc.clone(), vc.clone(), table, wb, pos, span=20)
    out = torch.full((3, 2, 4, 16), 7.0)
    got = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=20, out=out[:, 1])
    assert got.data_ptr() == out[:, 1].data_ptr() and torch.equal(out[:, 1], want)
    assert bool((out[:, 0] == 7).all())
    for bad in (torch.empty(3, 4, 8), torch.empty(3, 4, 16, dtype=torch.float64),
                torch.empty(3, 16, 4).transpose(1, 2), torch.empty(1, 4, 16).expand(3, -1, -1)):
        with pytest.raises(ValueError, match="out must be"):
            attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=20, out=bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 7])
@pytest.mark.parametrize("rope", [False, True])
def test_decode_attention_cuda_strided_out_is_the_contiguous_one(splits, rope):
    """The kernel (and its split merge) writing one position of a [B, T, H, D] output gives
    the bits of a contiguous out, and writes nothing else of it."""
    assert extension_available(), "the CUDA extension did not build"
    B, H, Hkv, D, S = 5, 32, 8, 128, 300
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(B, H, Hkv, D, S, torch.bfloat16,
                                                        "cuda", bs=64, last_at_end=True)
    r = _rope_case(B, D, torch.bfloat16, "cuda", norm=False, shared=True) if rope else None
    want = attention.decode_attention(q, kn, vn, kc.clone(), vc.clone(), table, wb, pos,
                                      span=S, splits=splits, rope=r)
    out = torch.full((B, 3, H, D), 7.0, dtype=torch.bfloat16, device="cuda")
    attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=S, splits=splits,
                               rope=r, out=out[:, 1])
    assert torch.equal(out[:, 1], want)
    assert bool((out[:, 0] == 7).all()) and bool((out[:, 2] == 7).all())


def _positions_case(B, H, Hkv, D, T, p0, dtype, device, *, rope, norm=True, seed=3):
    """T new positions per row from p0 on a dense cache of 10 positions (the fast AR's: row
    b's one block is slot b), positions before p0 filled; (q, k, v [B, T, ...], caches,
    table, wblock, pos, Rope with cs [B, T, D/2, 2] or None)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    q, k, v = r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, D)
    kc, vc = r(B, Hkv, 10, D), r(B, Hkv, 10, D)
    rows = torch.arange(B, device=device)
    pos = torch.full((B,), p0, dtype=torch.int64, device=device)
    ro = None
    if rope:
        w = lambda: (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(device)  # noqa: E731
        cs = functional.rope_table(10, D, 10000.0).to(dtype).to(device)[p0: p0 + T]
        ro = attention.Rope(w() if norm else None, w() if norm else None,
                            cs[None].expand(B, -1, -1, -1), 1e-6)
    return q, k, v, kc, vc, rows[:, None].contiguous(), rows, pos, ro


def _one_by_one(q, k, v, kc, vc, table, wb, pos, ro, **kw):
    """decode_attention's T one-position calls in order (the reference of the T form)."""
    outs = []
    for t in range(q.shape[1]):
        one = None if ro is None else attention.Rope(ro.qw, ro.kw, ro.cs[:, t], ro.eps)
        outs.append(attention.decode_attention(q[:, t], k[:, t], v[:, t], kc, vc, table, wb,
                                               pos + t, span=10, rope=one, **kw))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("T,p0", [(2, 0), (2, 4), (3, 1)])
@pytest.mark.parametrize("rope", [False, True])
def test_decode_attention_positions_are_the_calls_one_by_one(T, p0, rope):
    """q [B, T, H, D]: row b's queries at pos[b] + t, each attending causally, the T keys
    and values stored — the T one-position calls' outputs and caches (the fallback here)."""
    case = _positions_case(3, 4, 2, 16, T, p0, torch.float32, "cpu", rope=rope)
    q, k, v, kc, vc, table, wb, pos, ro = case
    before, kc2, vc2 = kc.clone(), kc.clone(), vc.clone()
    want = _one_by_one(q, k, v, kc2, vc2, table, wb, pos, ro)
    out = torch.full((3, T, 4, 16), 7.0)
    got = attention.decode_attention(q, k, v, kc, vc, table, wb, pos, span=10, rope=ro, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    stored = slice(p0, p0 + T)  # the T keys written, the rest untouched
    assert not torch.isclose(kc[:, :, stored], before[:, :, stored]).any()
    assert torch.equal(kc[:, :, :p0], before[:, :, :p0])


def test_decode_attention_positions_contract():
    """The T form refuses mismatched k/v, a cs without its T positions and a wrong out."""
    q, k, v, kc, vc, table, wb, pos, ro = _positions_case(3, 4, 2, 16, 2, 0, torch.float32,
                                                          "cpu", rope=True)
    with pytest.raises(ValueError, match="k_new/v_new must be"):
        attention.decode_attention(q, k[:, :1], v[:, :1], kc, vc, table, wb, pos, span=10)
    with pytest.raises(ValueError, match=r"rope\.cs must be"):
        attention.decode_attention(q, k, v, kc, vc, table, wb, pos, span=10,
                                   rope=attention.Rope(ro.qw, ro.kw, ro.cs[:, 0], ro.eps))
    with pytest.raises(ValueError, match="out must be"):
        attention.decode_attention(q, k, v, kc, vc, table, wb, pos, span=10,
                                   out=torch.empty(3, 2, 4, 8))
    with pytest.raises(ValueError, match="heads and dims must be packed"):
        attention.decode_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, kc,
                                   vc, table, wb, pos, span=10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# B = 1: a block per query head (R = 1); B = 64: 2 x 64 x 8 kv groups fill the H200 (R = 4)
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("p0", [0, 5])
@pytest.mark.parametrize("rope,norm", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("splits,pdl", [(1, False), (1, True), (4, False)])
def test_decode_attention_cuda_pair_is_two_launches_bit_for_bit(dtype, B, p0, rope, norm,
                                                                 splits, pdl):
    """Two positions per row in one launch (the second query reads the first's key/value
    from k_new/v_new): the outputs and caches of the two one-position launches, bit for
    bit, with the fused q/k norm + RoPE, split positions and PDL; strided rows too."""
    assert extension_available(), "the CUDA extension did not build"
    q, k, v, kc, vc, table, wb, pos, ro = _positions_case(B, 32, 8, 128, 2, p0, dtype, "cuda",
                                                          rope=rope, norm=norm)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)  # the projection's rows
    qs, ks, vs = qkv.split([32 * 128, 8 * 128, 8 * 128], -1)
    qs, ks, vs = qs.view(q.shape), ks.view(k.shape), vs.view(v.shape)
    kc2, vc2 = kc.clone(), vc.clone()
    want = _one_by_one(q, k, v, kc2, vc2, table, wb, pos, ro, splits=splits, pdl=pdl)
    got = attention.decode_attention(qs, ks, vs, kc, vc, table, wb, pos, span=10, rope=ro,
                                     splits=splits, pdl=pdl)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_fast_kv_kernel_path_attends_two_positions_as_its_torch_path():
    """FastKV with a decode-attention kernel (its CPU fallback here) on two positions at once
    (one launch per position, each into its slice of one output; positions 0 and 1 of a
    frame) and then one: the outputs and caches of the torch path, with RoPE folded into
    the launches too (`norm_rope_attend`, per position) and without."""
    import functools

    from engine.cache import FastKV
    from engine.config import ModelConfig, TransformerConfig, preset

    base = preset("tiny")
    fast = TransformerConfig(n_layer=1, dim=base.slow.dim, n_head=4, n_local_heads=2,
                             head_dim=64, intermediate_size=64, vocab_size=4096, max_seq_len=11)
    cfg = ModelConfig(slow=base.slow, fast=fast, ids=base.ids, num_codebooks=10)
    kernel = functools.partial(attention.decode_attention, kernel=False)
    g = torch.Generator().manual_seed(2)
    B = 3
    rope = functional.rope_table(10, 64, 10000.0)
    plain = FastKV(cfg, 4, device="cpu", dtype=torch.float32)
    launched = FastKV(cfg, 4, device="cpu", dtype=torch.float32, kernel=kernel)
    folded = FastKV(cfg, 4, device="cpu", dtype=torch.float32, kernel=kernel, rope_rows=4)
    for pos, T in ((0, 2), (2, 1)):
        q = torch.randn(B, T, 4, 64, generator=g)
        k, v = torch.randn(B, T, 2, 64, generator=g), torch.randn(B, T, 2, 64, generator=g)
        cs = rope[pos: pos + T][None].expand(B, -1, -1, -1)
        qr, kr = functional.norm_rope_qk(q, k, None, None, cs, 1e-6)
        want = plain.at(pos, B)(0, qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2))
        got = launched.at(pos, B)(0, qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2))
        attend = folded.at(pos, B)
        assert attend.norm_rope_attend is not None
        fused = attend.norm_rope_attend(0, q, k, v, None, None, cs, 1e-6)
        assert want.shape == got.shape == fused.shape == (B, 4, T, 64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    for kv in (launched, folded):
        torch.testing.assert_close(kv.k[:, :B, :, :3], plain.k[:, :B, :, :3])
        torch.testing.assert_close(kv.v[:, :B, :, :3], plain.v[:, :B, :, :3])
    assert bool(plain.k[:, :B, :, :3].abs().sum(-1).gt(0).all())  # all three positions stored


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_fast_kv_two_positions_cuda_as_its_torch_path(pdl, rope, graph):
    """FastKV with csrc's decode attention on the fast AR's first call (positions 0 and 1:
    two launches, the second reading what the first stored, with PDL and inside a CUDA
    graph too), then position 2: its torch path's outputs and caches within bf16 rounding."""
    import functools

    from engine.cache import FastKV
    from engine.config import preset

    assert extension_available(), "the CUDA extension did not build"
    cfg = preset("s2-pro")
    f, B = cfg.fast, 2
    kernel = functools.partial(attention.decode_attention, pdl=pdl)
    launched = FastKV(cfg, 4, device="cuda", dtype=torch.bfloat16, kernel=kernel,
                      rope_rows=4 if rope else 0)
    plain = FastKV(cfg, 4, device="cuda", dtype=torch.bfloat16)
    table = functional.rope_table(10, f.head_dim, 1e6).to(torch.bfloat16).cuda()
    g = torch.Generator().manual_seed(5)
    steps = []
    for pos, T in ((0, 2), (2, 1)):
        qkv = torch.randn(B, T, f.q_size + 2 * f.kv_size, generator=g).to(torch.bfloat16).cuda()
        q, k, v = qkv.split([f.q_size, f.kv_size, f.kv_size], dim=-1)
        q = q.view(B, T, f.n_head, f.head_dim)
        k = k.view(B, T, f.n_local_heads, f.head_dim)
        v = v.view(B, T, f.n_local_heads, f.head_dim)
        cs = table[pos: pos + T][None].expand(B, -1, -1, -1)
        steps.append((pos, q, k, v, cs))

    def run(kv, fused):  # type: ignore[no-untyped-def]
        outs = []
        for pos, q, k, v, cs in steps:
            attend = kv.at(pos, B)
            if fused:
                outs.append(attend.norm_rope_attend(0, q, k, v, None, None, cs, 1e-6))
            else:
                qr, kr = functional.norm_rope_qk(q, k, None, None, cs, 1e-6)
                outs.append(attend(0, qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2)))
        return outs

    want = run(plain, False)
    if graph:
        run(launched, rope)  # warm-up outside the capture
        launched.k.zero_()
        launched.v.zero_()
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            got = run(launched, rope)
        cg.replay()
    else:
        got = run(launched, rope)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(launched.k[0, :B, :, :3].float(), plain.k[0, :B, :, :3].float(),
                               rtol=2e-2, atol=2e-2)
    assert torch.equal(launched.v[0, :B, :, :3], plain.v[0, :B, :, :3])


def _rope_case(B, D, dtype, device, *, norm=True, shared=False, seed=11):
    """A Rope for one position per row: norm weights near 1, a real rotation table row per
    row (or one row for all: the fast AR's shared position)."""
    g = torch.Generator().manual_seed(seed)
    w = lambda: (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(device)  # noqa: E731
    table = functional.rope_table(64, D, 10000.0).to(dtype).to(device)  # [64, D/2, 2]
    rows = torch.randint(0, 64, (1 if shared else B,), generator=g).to(device)
    return attention.Rope(w() if norm else None, w() if norm else None, table[rows], 1e-6)


@pytest.mark.parametrize("norm,shared", [(True, False), (False, False), (False, True)])
def test_decode_attention_rope_fallback_is_norm_rope_then_attention(norm, shared):
    """With `rope`, q and k are normed and rotated first (functional.norm_rope_qk) and the
    cache stores the rotated k: the same as rotating, then calling without it."""
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(4, 4, 2, 16, 12, torch.float32, "cpu",
                                                        bs=4)
    rope = _rope_case(4, 16, torch.float32, "cpu", norm=norm, shared=shared)
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=12, rope=rope)
    q2, k2 = attention.apply_rope(q, kn, rope)
    cs = rope.cs[:, None].expand(4, 1, 8, 2) if shared else rope.cs[:, None]
    want_q, want_k = functional.norm_rope_qk(q[:, None], kn[:, None], rope.qw, rope.kw, cs, 1e-6)
    assert torch.equal(q2, want_q[:, 0]) and torch.equal(k2, want_k[:, 0])
    want = attention.decode_attention(q2, k2, vn, kc2, vc2, table, wb, pos, span=12)
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(k2, kn)  # the rotation did something
    # what the kernel takes (checked on any device; it runs where built): head_dim 48, 64,
    # 128 (an even number of elements per lane), one dtype, cs [B or 1, D/2, 2] packed
    assert not attention.rope_supported(q, rope)  # head_dim 16
    q48 = torch.zeros(4, 4, 48)
    r48 = _rope_case(4, 48, torch.float32, "cpu", norm=norm, shared=shared)
    assert attention.rope_supported(q48, r48)
    assert attention.rope_supported(q48[:3], r48) == shared  # cs rows: B or 1
    assert not attention.rope_supported(q48.double(), r48)
    assert not attention.rope_supported(q48, r48._replace(cs=r48.cs.transpose(1, 2)))
    if norm:
        assert not attention.rope_supported(q48, r48._replace(kw=None))
    d40 = torch.zeros(2, 4, 40)
    assert not attention.rope_supported(d40, _rope_case(2, 40, torch.float32, "cpu"))


def test_model_hands_raw_q_k_to_an_attend_that_norms_and_rotates():
    """An attend offering norm_rope_attend gets q/k before the norm and RoPE and gives the
    same hidden states as the model's own norm_rope_qk followed by the plain attend (the
    decode attends with a kernel and fuse_rope, here through the kernel's CPU fallback)."""
    import functools

    from engine.cache import PagedDecodeAttend, SlowKVCache
    from engine.config import preset
    from engine.model import DualAR

    cfg = preset("tiny")
    torch.manual_seed(0)
    model = DualAR(cfg).eval()
    kernel = functools.partial(attention.decode_attention, kernel=False)
    B, pos = 3, torch.tensor([0, 5, 9])
    cols = torch.randint(0, 100, (B, cfg.frame_rows, 1))
    outs, seen = [], []
    for fuse in (False, True):
        cache = SlowKVCache(cfg.slow, 4, 16, 64, device="cpu", dtype=torch.float32)
        tables = torch.tensor([[0], [1], [2]])
        attend = PagedDecodeAttend(cache, tables, tables[:, 0].clone(), pos, 16, kernel, fuse)
        assert (attend.norm_rope_attend is not None) == fuse
        if fuse:
            attend.norm_rope_attend = functools.partial(
                lambda raw, *a: seen.append(a[1].shape) or raw(*a), attend.norm_rope_attend)
        with torch.no_grad():
            outs.append(model.forward_slow(cols, pos[:, None], attend))
        outs.append(cache.k.clone())
    assert seen and seen[0] == (B, 1, cfg.slow.n_head, cfg.slow.head_dim)  # [B, T, H, Dh]
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[3], outs[1], rtol=1e-6, atol=1e-6)  # the stored keys


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,D,S,norm,shared", [
    (1, 32, 8, 128, 300, True, False), (64, 32, 8, 128, 300, True, False),
    (34, 32, 8, 128, 256, True, False), (4, 32, 8, 128, 10, False, True),
    (64, 32, 8, 128, 10, False, True), (3, 4, 2, 48, 17, True, False),
    (5, 16, 8, 64, 40, False, False)])
@pytest.mark.parametrize("splits", [1, 0, 7])
def test_decode_attention_cuda_fused_rope(dtype, B, H, Hkv, D, S, norm, shared, splits):
    """The kernel's fused q/k norm + RoPE against functional.norm_rope_qk then the kernel:
    the stored keys and the output agree to the last bf16 ulp at most (the reference's
    roundings are reproduced; only the float32 sum of squares' order differs)."""
    assert extension_available(), "the CUDA extension did not build"
    q, kn, vn, kc, vc, table, wb, pos = _attention_case(B, H, Hkv, D, S, dtype, "cuda", bs=64,
                                                        last_at_end=True)
    rope = _rope_case(B, D, dtype, "cuda", norm=norm, shared=shared)
    assert attention.rope_supported(q, rope)
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=S, splits=splits,
                                     rope=rope)
    q2, k2 = attention.apply_rope(q, kn, rope)
    want = attention.decode_attention(q2, k2, vn, kc2, vc2, table, wb, pos, span=S,
                                      splits=splits)
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(kc.float(), kc2.float(), rtol=tol, atol=tol)
    assert torch.equal(vc, vc2)
    if dtype == torch.bfloat16:
        assert float((kc != kc2).float().mean()) < 1e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * tol, atol=2 * tol)


# ---------------------------------------------------------------------- sampling
def _draw_case(B, V, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, V, generator=g)).to(dtype).to(device)
    temp = (torch.rand(B, generator=g) * 1.2).to(device)
    temp[: B // 8] = 0  # greedy rows
    top_p = (0.5 + 0.5 * torch.rand(B, generator=g)).to(device)
    top_k = torch.randint(1, 129, (B,), generator=g).to(device)
    seed_t = torch.randint(0, 2**31, (B,), generator=g).to(device)
    step = torch.randint(0, 500, (B,), generator=g).to(device)
    stream = torch.randint(1, 26, (B,), generator=g).to(device)
    return logits, temp, top_p, top_k, seed_t, step, stream


def test_sample_topk_fallback_and_contract():
    from engine.sampler import sample

    args = _draw_case(16, 300, "cpu")
    assert torch.equal(sampling.sample_topk(*args), sample(*args))
    a = list(args)
    a[6] = 3  # one stream for all rows, as an int
    assert torch.equal(sampling.sample_topk(*a), sample(*args[:6], 3))
    for i, bad, err in ((1, args[1].double(), TypeError), (3, args[3].int(), TypeError),
                        (4, args[4][:3], TypeError), (0, args[0][None], TypeError)):
        a = list(args)
        a[i] = bad
        with pytest.raises(err):
            sampling.sample_topk(*a)


def test_sample_topk_embed_fallback_and_contract():
    """The draw with the drawn ids' table rows: off CUDA the draw, then the lookup; a table
    without a row for every drawable index is refused (not an out-of-range read)."""
    from engine.sampler import sample

    args = _draw_case(16, 300, "cpu")
    table = torch.randn(300, 24)
    ids, rows = sampling.sample_topk_embed(*args, table)
    assert torch.equal(ids, sample(*args)) and torch.equal(rows, table[ids])
    ref_ids, ref_rows = sampling.sample_embed(*args, table)
    assert torch.equal(ref_ids, ids) and torch.equal(ref_rows, rows)
    for bad in (table[:299], table[None], torch.randn(300)):
        with pytest.raises(ValueError, match="R >= V"):
            sampling.sample_topk_embed(*args, bad)
    a = list(args)
    a[3] = a[3].int()
    with pytest.raises(TypeError):  # the draw's own contract first
        sampling.sample_topk_embed(*a, table)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pdl", [False, True])
def test_sample_topk_embed_cuda_copies_the_drawn_rows(pdl, monkeypatch):
    """csrc's draw with the row copy: the ids of the plain launch, each output row
    bit-equal to the table's row (bf16 and float32 tables, a wide row, a row of one 16-byte
    vector), copied by the launch itself (the lookup is made to fail there); rows the kernel
    cannot copy (not a multiple of 16 bytes) take the lookup."""
    import types

    assert extension_available(), "the CUDA extension did not build"

    def no_lookup(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the launch should have copied the rows")

    lookup = sampling.F
    for B, V, D, dt in ((1, 4096, 2560, torch.bfloat16), (64, 4096, 2560, torch.bfloat16),
                        (5, 100, 8, torch.bfloat16), (7, 300, 36, torch.float32),
                        (3, 300, 12, torch.bfloat16)):
        args = _draw_case(B, V, "cuda", seed=B + D)
        table = torch.randn(V + 3, D, device="cuda").to(dt)
        in_kernel = D * table.element_size() % 16 == 0
        monkeypatch.setattr(sampling, "F", types.SimpleNamespace(embedding=no_lookup)
                            if in_kernel else lookup)
        ids, rows = sampling.sample_topk_embed(*args, table, pdl=pdl)
        assert torch.equal(ids, sampling.sample_topk(*args, pdl=pdl)), (B, V, D)
        assert rows.dtype == dt and rows.shape == (B, D)
        assert torch.equal(rows, table[ids]), (B, V, D)
    g = torch.cuda.CUDAGraph()  # captured: the rows come from the replay's draw
    args = _draw_case(2, 4096, "cuda", seed=3)
    table = torch.randn(4096, 2560, device="cuda").to(torch.bfloat16)
    sampling.sample_topk_embed(*args, table, pdl=pdl)
    with torch.cuda.graph(g):
        ids, rows = sampling.sample_topk_embed(*args, table, pdl=pdl)
    args[0].copy_(torch.randn_like(args[0]))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows, table[ids])
    assert torch.equal(ids, sampling.sample_topk(*args, pdl=pdl))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B,V", [(64, 4097), (33, 4096), (5, 100), (1, 4097)])
def test_sample_topk_cuda_kernel_matches_fallback(B, V):
    from engine.sampler import sample

    assert extension_available(), "the CUDA extension did not build"
    args = list(_draw_case(B, V, "cuda", seed=B + V))
    if B == 33:  # strided rows: a view into wider logits
        args[0] = torch.cat([args[0], args[0][:, :7]], dim=1)[:, :V]
    got, want = sampling.sample_topk(*args), sample(*args)
    greedy = args[1] == 0
    assert torch.equal(got[greedy], want[greedy])
    if B >= 20:  # a float-rounding flip at a top-p boundary is rare, not impossible
        assert (got == want).float().mean() >= 0.95
    # every draw is among the row's top_k values (rank by value < top_k)
    logits, top_k = args[0].float(), args[3]
    rank = (logits > logits.gather(1, got[:, None])).sum(1)
    assert bool((rank < top_k).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sample_topk_cuda_bf16_ties():
    """bf16 logits tie often: greedy takes a maximum, draws stay within top_k by value."""
    assert extension_available(), "the CUDA extension did not build"
    args = list(_draw_case(64, 4097, "cuda", dtype=torch.bfloat16, seed=7))
    args[0] = (args[0].float() * 4).round().to(torch.bfloat16) / 4  # many exact ties
    got = sampling.sample_topk(*args)
    logits = args[0].float()
    greedy = args[1] == 0
    assert torch.equal(logits[greedy].gather(1, got[greedy][:, None])[:, 0],
                       logits[greedy].max(1).values)
    rank = (logits > logits.gather(1, got[:, None])).sum(1)
    assert bool((rank < args[3]).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("V", [4097, 100])
def test_sample_topk_cuda_all_equal_and_few_distinct(V):
    """Rows where every key lands in one radix bin (all equal, signed zeros among them) or in
    a handful of values: ties rank by index, so a greedy row takes the lowest index of its
    maximum and every draw is among the row's top_k by (value descending, index ascending)."""
    assert extension_available(), "the CUDA extension did not build"
    args = list(_draw_case(48, V, "cuda", seed=11))
    logits = torch.zeros(48, V, device="cuda")
    logits[16:32] = torch.randint(-2, 3, (16, V), device="cuda").float()  # five values
    logits[32:, ::7] = -0.0  # signed zeros tie with the zeros
    args[0] = logits
    args[1][[0, 1, 16, 17, 32, 33]] = 0  # greedy rows in each group
    args[2] = torch.ones_like(args[2])  # top-p keeps every candidate: top_k alone cuts
    got = sampling.sample_topk(*args).cpu()
    vals, top_k, temp = logits.cpu(), args[3].cpu(), args[1].cpu()
    for b in range(48):
        row = vals[b].tolist()
        order = sorted(range(V), key=lambda i: (-row[i], i))
        allowed = order[: int(top_k[b])]
        if temp[b] == 0:
            assert int(got[b]) == order[0], (b, int(got[b]), order[0])
        else:
            assert int(got[b]) in allowed, (b, int(got[b]), allowed[:8])


# ---------------------------------------------------------------------- snake activation
def test_snake_fallback_and_snake_cat_semantics():
    from engine.codec.layers import snake as formula

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 33, generator=g)
    alpha = torch.rand(1, 5, 1, generator=g) + 0.2
    assert torch.equal(activation.snake(x, alpha), formula(x, alpha))
    assert torch.equal(activation.snake(x, alpha.reshape(5)), formula(x, alpha))
    tail = torch.randn(2, 5, 6, generator=g)
    assert torch.equal(activation.snake_cat(tail, x, alpha),
                       torch.cat([tail, formula(x, alpha)], dim=-1))
    assert activation.snake_cat(tail[..., :0], x, alpha).shape == (2, 5, 33)


@pytest.mark.parametrize("x,alpha,err", [
    (torch.zeros(5, 33), torch.ones(5), ValueError),                  # not [B, C, T]
    (torch.zeros(2, 5, 33), torch.ones(4), ValueError),               # alpha per channel
    (torch.zeros(2, 5, 33), torch.ones(5, dtype=torch.float64), TypeError),
])
def test_snake_contract(x, alpha, err):
    with pytest.raises(err):
        activation.snake(x, alpha)
    with pytest.raises(ValueError, match="tail"):
        activation.snake_cat(torch.zeros(2, 4, 6), torch.zeros(2, 5, 33), torch.ones(5))


@pytest.mark.parametrize("kernel_ops,fold", [(False, False), (False, True), (True, True)])
def test_streaming_snake_conv_pairs_match_offline(kernel_ops, fold):
    """stream_sequential hands each Snake to the conv after it (its input built by snake_cat):
    a decoder block streamed in uneven chunks equals the offline block — with the torch ops,
    with the residual units' conv biases folded into the Snake / bias_residual ops after
    them, and with the kernel wrappers (their fallbacks here), as the engine's ops run them
    on a GPU."""
    from engine.codec.layers import (
        CodecOps,
    )

    calls = {"snake_bias": 0, "bias_residual": 0}
    base = (CodecOps(activation.snake, activation.snake_cat, activation.bias_residual)
            if kernel_ops else CodecOps())

    def snake(x, alpha, bias=None):  # type: ignore[no-untyped-def]
        calls["snake_bias"] += bias is not None
        return base.snake(x, alpha, bias)

    def bias_residual(x, y, bias):  # type: ignore[no-untyped-def]
        calls["bias_residual"] += 1
        return base.bias_residual(x, y, bias)

    ops = CodecOps(snake, base.snake_cat, bias_residual, fold_bias=fold)
    block = unit_block(8)
    got, want = stream_vs_offline(block, torch.randn(1, 8, 50), ops)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the folded path ran once per chunk, or not at all
    assert calls == ({"snake_bias": 4, "bias_residual": 4} if fold
                     else {"snake_bias": 0, "bias_residual": 0})


def test_bias_residual_fallback_and_contract():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, 5, 9, generator=g), torch.randn(2, 5, 9, generator=g)
    b = torch.randn(5, generator=g)
    assert torch.equal(activation.bias_residual(x, y, b), x + (y + b[None, :, None]))
    assert torch.equal(activation.snake(y, torch.ones(5), b), activation.snake_torch(y + b[:, None],
                                                                                torch.ones(5)))
    with pytest.raises(ValueError, match="one shape"):
        activation.bias_residual(x, y[..., :4], b)
    with pytest.raises(ValueError, match="bias has 4 values"):
        activation.bias_residual(x, y, b[:4])
    with pytest.raises(TypeError, match="bias"):
        activation.snake(y, torch.ones(5), b.double())


def _assert_kernel_rounding(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """A codec kernel's result against the float32 reference it computes."""
    if dtype == torch.float32:  # the same float32 ops in the same order
        torch.testing.assert_close(got, want, rtol=2e-7, atol=2e-6)
    else:  # one rounding to bf16/fp16 at the end
        ulp = torch.finfo(dtype).eps
        assert float(((got.float() - want).abs() / want.abs().clamp_min(1e-3)).max()) <= ulp


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# (3, 8, 1, 1), (2, 4, 2, 1): snake_cat rows shorter than a 16-byte store; (1, 3, 2, 1): its
# scalar path in every dtype (9 elements)
@pytest.mark.parametrize("B,C,T,P", [(64, 96, 16384, 6), (3, 768, 256, 54), (2, 7, 33, 1),
                                     (1, 192, 8, 0), (3, 8, 1, 1), (2, 4, 2, 1), (1, 3, 2, 1)])
def test_snake_cuda_kernel_matches_fallback(dtype, B, C, T, P):
    assert extension_available(), "the CUDA extension did not build"
    g = torch.Generator(device="cuda").manual_seed(B * C + T)
    alpha = (torch.rand(C, device="cuda", generator=g) + 0.1).to(dtype)
    wide = (3 * torch.randn(B, C, T + 5, device="cuda", generator=g)).to(dtype)
    # contiguous and aligned (16-byte vectors where T allows), then strided and misaligned
    # (the per-row kernel's scalar path)
    for x in (wide[..., :T].contiguous(), wide[..., 5:]):
        want = activation.snake_torch(x.float(), alpha.float())  # float32 math, as the kernel
        got = activation.snake(x, alpha)
        _assert_kernel_rounding(got, want, dtype)
        # snake_cat: one flat pass over [B, C, P + T] (16-byte stores across row ends); a
        # strided tail too
        tail = torch.randn(B, C, P + 3, device="cuda", generator=g).to(dtype)
        for t in (tail[..., :P].contiguous(), tail[..., 3:]):
            both = activation.snake_cat(t, x, alpha)
            assert torch.equal(both[..., :P], t) and torch.equal(both[..., P:], got)
            assert torch.equal(activation.snake_cat(t, x[..., :0], alpha), t)  # no new samples


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,C,T", [(64, 192, 8192), (3, 768, 256), (2, 7, 33)])
def test_folded_bias_cuda_kernels_match_fallback(dtype, B, C, T):
    """snake with a conv's bias folded in, and bias_residual, against the torch ops in the
    reference's rounding order (conv output + bias rounded to the dtype first)."""
    assert extension_available(), "the CUDA extension did not build"
    g = torch.Generator(device="cuda").manual_seed(B + C + T)
    x, y = ((2 * torch.randn(B, C, T + 3, device="cuda", generator=g)).to(dtype) for _ in range(2))
    alpha = (torch.rand(C, device="cuda", generator=g) + 0.1).to(dtype)
    bias = torch.randn(C, device="cuda", generator=g).to(dtype)
    for xs, ys in ((x[..., :T].contiguous(), y[..., :T].contiguous()), (x[..., 3:], y[..., 3:])):
        got = activation.snake(ys, alpha, bias)
        want = activation.snake_torch((ys + bias[:, None]).float(), alpha.float())
        _assert_kernel_rounding(got, want, dtype)
        assert torch.equal(activation.bias_residual(xs, ys, bias), xs + (ys + bias[:, None]))
        for P in (0, 1, 6, 54):  # the flat snake_cat pass with a folded bias
            tail = torch.randn(B, C, P, device="cuda", generator=g).to(dtype)
            both = activation.snake_cat(tail, ys, alpha, bias)
            assert torch.equal(both[..., :P], tail) and torch.equal(both[..., P:], got)


def test_ops_are_chosen_once_per_engine():
    """build_ops decides every kernel an engine runs: on a CPU the reference math and the
    torch fallbacks (whatever is asked for), no process-wide switch involved."""
    import functools

    from engine import functional
    from engine.codec.layers import CodecOps
    from engine.ops import REFERENCE, build_ops

    cpu = build_ops("cpu", fused="auto", kernels=True, sampler_kernel=True, codec_kernels=True,
                    split_kv=True)
    assert cpu.fused == "reference" and cpu.decode_attention is None and not cpu.packed_ffn
    assert cpu.rms_norm is functional.rms_norm and cpu.sample is sampling.sample
    assert cpu.codec == CodecOps() and not cpu.codec.fold_bias
    assert isinstance(cpu.shift_window, functools.partial)
    assert REFERENCE.codec == CodecOps() and REFERENCE.fused == "reference"
    with pytest.raises(ValueError, match="fused ops must be one of"):
        build_ops("cpu", fused="fast")


# ---------------------------------------------------------------------- q/k norm + RoPE
def _qk_case(B, T, H, Hkv, D, dtype, device, *, norm=True, broadcast=False, seed=0):
    """q and k as the model makes them (column slices of one qkv output), the norm weights
    and a position table slice."""
    from engine import functional

    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)).to(dtype).to(device)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    qw = (0.5 + torch.rand(D, generator=g)).to(dtype).to(device) if norm else None
    kw = (0.5 + torch.rand(D, generator=g)).to(dtype).to(device) if norm else None
    table = functional.rope_table(4096, D, 1e6).to(device)
    if broadcast:  # the fast AR: one position for every row
        cs = table[3:3 + T].unsqueeze(0).expand(B, -1, -1, -1)
    else:
        cs = table[torch.randint(0, 4096, (B, T), generator=g).to(device)]
    return q.view(B, T, H, D), k.view(B, T, Hkv, D), qw, kw, cs


def test_norm_rope_qk_fallback_and_contract():
    """Off CUDA (or with kernel=False) the wrapper is the reference function itself."""
    from engine import functional
    from engine.kernels import qk_rope

    q, k, qw, kw, cs = _qk_case(2, 3, 4, 2, 16, torch.bfloat16, "cpu")
    got = qk_rope.norm_rope_qk(q, k, qw, kw, cs, 1e-6)
    want = functional.norm_rope_qk(q, k, qw, kw, cs, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, Dh\]"):
        qk_rope.norm_rope_qk(q[0], k, qw, kw, cs, 1e-6)
    assert not qk_rope.supported(q, k, qw, kw, cs)  # CPU tensors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,H,Hkv,D,norm,broadcast", [
    (1, 1, 32, 8, 128, True, False),    # the slow AR's decode step (S2-Pro)
    (64, 1, 32, 8, 128, True, False),
    (16, 24, 32, 8, 128, True, False),  # a prefill chunk
    (64, 1, 32, 8, 128, False, True),   # the fast AR: no q/k norm, one position for all
    (3, 5, 4, 1, 48, True, False),
])
def test_norm_rope_qk_kernel_matches_reference(dtype, B, T, H, Hkv, D, norm, broadcast):
    """One launch, the reference's math and roundings: bf16 equal but for rare one-ulp
    differences (rsqrt and the sum's order in float32), float32 to a few ulps."""
    from engine import functional
    from engine.kernels import qk_rope

    assert qk_rope.available(), "triton is not importable"
    q, k, qw, kw, cs = _qk_case(B, T, H, Hkv, D, dtype, "cuda", norm=norm, broadcast=broadcast)
    assert qk_rope.supported(q, k, qw, kw, cs)
    got = qk_rope.norm_rope_qk(q, k, qw, kw, cs, 1e-6)
    want = functional.norm_rope_qk(q, k, qw, kw, cs, 1e-6)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        tol = 2e-6 if dtype == torch.float32 else 2 ** -7  # one bf16 ulp of |x| < 2
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
        if dtype == torch.bfloat16:
            assert (a != b).float().mean().item() < 1e-3


# ---------------------------------------------------------------------- small-M linear
# csrc/linear.cu (`linear_small_m`): engine/kernels/linear.py's gemv / fp8_gemv wrappers, the
# per-shape plan (LinearPlan, load_plan) and the Ops.linear it builds (make_linear).
def _bf16(*shape, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)


def test_linear_fallbacks_are_the_references():
    import torch.nn.functional as F

    from engine.kernels.fp8_triton import fp8_linear_w8a8_torch
    from engine.quant import fp8_linear_torch, quantize_fp8

    x, w = _bf16(2, 3, 64), _bf16(40, 64, seed=1)
    fw = quantize_fp8(w)
    assert torch.equal(linear.gemv(x, w), F.linear(x, w))
    assert torch.equal(linear.fp8_gemv(x, fw), fp8_linear_torch(x, fw))
    assert torch.equal(linear.gemv(x, w, splits=3, kwarps=2, kernel=False), F.linear(x, w))
    for v in linear.VARIANTS:  # CPU tensors: the variant's reference (7: W8A8's)
        want = fp8_linear_w8a8_torch(x, fw) if v == 7 else fp8_linear_torch(x, fw)
        assert torch.equal(linear.fp8_gemv(x, fw, variant=v), want)
    assert not torch.equal(fp8_linear_w8a8_torch(x, fw), fp8_linear_torch(x, fw))
    assert torch.equal(linear.gemv(x, w, variant=1), F.linear(x, w))
    assert linear.gemv(x[0, 0], w).shape == (40,)  # one row, x [K]
    assert linear.fp8_gemv(x[:, :0], fw).shape == (2, 0, 40)  # no rows
    # the kernel takes the shape wherever the extension is built (a CUDA machine), never on
    # a CPU-only one; variants 2 and 3 never take bf16 weights
    built = extension_available()
    assert linear.supports(1, 40, 64, False) == (built and linear._mma_current())
    assert not linear.supports(1, 40, 64, False, variant=2)
    assert not linear.supports(65, 40, 64, True) and not linear.supports(1, 40, 40, True)


def _wide(rows, cols, start, k):
    return _bf16(rows, cols)[:, start:start + k]


@pytest.mark.parametrize("make,match", [
    (lambda: (_bf16(2, 64).float(), _bf16(8, 64)), "x must be bfloat16"),
    (lambda: (_bf16(2, 64), _bf16(8, 64).float()), "weight must be a torch.bfloat16"),
    (lambda: (_bf16(2, 40), _bf16(8, 40)), "multiple of 16"),
    (lambda: (_bf16(2, 48), _bf16(8, 64)), "last dim must be K = 64"),
    (lambda: (_bf16(65, 64), _bf16(8, 64)), "at most 64"),
    (lambda: (_bf16(2, 64), _bf16(64, 8).t()), "contiguous and 16-byte aligned"),
    (lambda: (_bf16(2, 128)[:, ::2], _bf16(8, 64)), "last dim must be contiguous"),
    (lambda: (_wide(3, 72, 4, 64), _bf16(8, 64)), "16-byte aligned"),  # base 8 bytes off
    (lambda: (_wide(3, 68, 0, 64), _bf16(8, 64)), "row stride 68"),  # 136-byte rows
    (lambda: (_bf16(3, 4, 64).transpose(0, 1), _bf16(8, 64)), "flatten to rows"),
])
def test_linear_contract(make, match):
    x, w = make()
    with pytest.raises(ValueError, match=match):
        linear.gemv(x, w)
    if w.dtype == torch.bfloat16 and "weight" not in match:  # the same checks for FP8 weights
        from engine.quant import quantize_fp8

        fw = quantize_fp8(w.contiguous())
        if not w.is_contiguous():
            fw = type(fw)(fw.q.t().contiguous().t(), fw.scale)
            match = "contiguous"
        with pytest.raises(ValueError, match=match):
            linear.fp8_gemv(x, fw)


@pytest.mark.parametrize("kw", [{"splits": -1}, {"splits": 65}, {"splits": True},
                                {"splits": 1.5}, {"kwarps": 3}, {"kwarps": 16},
                                {"variant": 8}, {"variant": -1}, {"variant": True}])
def test_linear_rejects_bad_splits_kwarps_and_variants(kw):
    with pytest.raises(ValueError, match=r"(splits|kwarps|variant) must be"):
        linear.gemv(_bf16(2, 64), _bf16(8, 64), **kw)


def test_linear_fp8_only_variants():
    from engine.quant import quantize_fp8

    x, w = _bf16(2, 64), _bf16(8, 64)
    for v in linear.FP8_VARIANTS:
        with pytest.raises(ValueError, match=f"variant {v} converts FP8 weights"):
            linear.gemv(x, w, variant=v)
        linear.fp8_gemv(x, quantize_fp8(w), variant=v)  # the reference on a CPU


def test_variant6_takes_fp8_weights_and_rows_it_can_stage():
    """Variant 6 stages x's rows in shared memory: bf16 weights, more than NORM_MAX_M rows or
    rows too long for the shared memory are refused by name (and `supports` says no); within
    that, every form is a valid launch (the reference off the kernel)."""
    from engine.quant import quantize_fp8

    x, w = _bf16(2, 256), _bf16(256, 256, seed=1)
    fw, nw = quantize_fp8(w), (1 + 0.1 * _bf16(256, seed=2))
    with pytest.raises(ValueError, match="variant 6 converts FP8 weights"):
        linear.gemv_normed(x, nw, 1e-6, w, variant=6)
    with pytest.raises(ValueError, match="variant 6 stages x's rows"):
        linear.fp8_gemv(_bf16(17, 256), fw, variant=6)
    big = quantize_fp8(_bf16(128, 8192, seed=3))
    with pytest.raises(ValueError, match="variant 6 stages x's rows"):
        linear.fp8_gemv(_bf16(16, 8192), big, variant=6)  # 16 x 8224 x 2 bytes > 160 KB
    assert not linear.supports(17, 256, 256, True, 6) and not linear.supports(1, 256, 256, False, 6)
    # the staging bound itself (supports is False anyway where no extension is built)
    assert linear._stages(16, 2560) and linear._stages(1, 9728)
    assert not linear._stages(17, 256) and not linear._stages(16, 8192)
    want = linear.normed_reference(x, nw, 1e-6, fw, False)
    assert torch.equal(linear.gemv_normed(x, nw, 1e-6, fw, variant=6, kernel=False), want)
    assert torch.equal(linear.fp8_gemv(x, fw, variant=6, kernel=False),
                       linear.fp8_gemv(x, fw, variant=0, kernel=False))
    assert linear._normed_problem(x, fw, nw, 1e-6, True, 1, 1, 6) is None


def test_variant7_takes_fp8_weights_and_rows_it_can_quantise():
    """Variant 7 (W8A8) quantises x's rows into shared memory: bf16 weights, more than
    NORM_MAX_M rows or rows too long are refused by name (the normed prologue's bound counts
    its bf16 rows too); within that the reference runs off the kernel: x quantised per
    1 x 128 block (`fp8_linear_w8a8_torch`), in every form."""
    from engine.kernels.fp8_triton import fp8_linear_w8a8_torch
    from engine.quant import quantize_fp8

    x, w = _bf16(2, 256), _bf16(256, 256, seed=1)
    fw, nw = quantize_fp8(w), (1 + 0.1 * _bf16(256, seed=2))
    with pytest.raises(ValueError, match="variant 7 converts FP8 weights"):
        linear.gemv(x, w, variant=7)
    with pytest.raises(ValueError, match="variant 7 quantises x's rows"):
        linear.fp8_gemv(_bf16(17, 256), fw, variant=7)
    big = quantize_fp8(_bf16(128, 10240, seed=3))
    with pytest.raises(ValueError, match="variant 7 quantises x's rows"):
        linear.fp8_gemv(_bf16(16, 10240), big, variant=7)  # 16 x 10304 + 5120 bytes > 160 KB
    linear.fp8_gemv(_bf16(8, 10240), big, variant=7)  # half the rows fit
    assert linear._quantises(16, 9728, False)  # S2-Pro's w2 at 16 rows: 161,536 bytes
    wide = quantize_fp8(_bf16(128, 4096, seed=4))
    h16 = _bf16(16, 4096)
    linear.fp8_gemv(h16, wide, variant=7)  # 16 x 4160 + 2048 bytes: fits
    with pytest.raises(ValueError, match="with the normed rows"):  # + 16 x 4128 x 2 bf16
        linear.gemv_normed(h16, (1 + 0.1 * _bf16(4096, seed=5)), 1e-6, wide, variant=7)
    assert linear._quantises(16, 4096, False) and not linear._quantises(16, 4096, True)
    assert not linear.supports(17, 256, 256, True, 7) and not linear.supports(1, 256, 256, False, 7)
    assert torch.equal(linear.fp8_gemv(x, fw, variant=7), fp8_linear_w8a8_torch(x, fw))
    assert torch.equal(linear.gemv_normed(x, nw, 1e-6, fw, variant=7),
                       fp8_linear_w8a8_torch(functional.rms_norm(x, nw, 1e-6), fw))
    w13 = quantize_fp8(_bf16(256, 256, seed=6))
    gu = fp8_linear_w8a8_torch(x, w13)
    torch.testing.assert_close(linear.gemv_swiglu(x, w13, variant=7),
                               torch.nn.functional.silu(gu[:, :128]) * gu[:, 128:], rtol=0, atol=0)


def test_variant6_probe_cases_are_what_they_claim():
    """The rows the bench's bit-equality probe and the CUDA test feed variants 6 and 5:
    `cancellation_case` (+P and -P cancel exactly, P from 2^10 to 2^30, the rest one MMA
    k-group of small full-mantissa products, rows staged exactly: span under 2^31) and
    `small_binade_case` (a 2^14 lead on a zero weight, the rest in [2^-17, 2^-14): exact f16
    subnormals once staged)."""
    w, x = linear.cancellation_case(16, 256, 256, seed=3, device="cpu")
    wf, xf = w.q.double(), x.double()
    assert torch.equal(xf[:, 0], -xf[:, 1]) and xf[0, 0] == 2**10 and xf[-1, 0] == 2**30
    assert not xf[:, 16:].any() and not wf[:, 16:].any() and bool((w.scale == 1).all())
    assert torch.equal(xf @ wf.T, xf[:, 2:16] @ wf[:, 2:16].T)  # +P and -P cancel
    # staged as variant 6 stages them (the row's largest into [2^14, 2^15)): exact in f16
    e = 14 - torch.floor(torch.log2(x.float().abs().amax(1, keepdim=True)))
    assert torch.equal((x.float() * 2**e).to(torch.float16).float() / 2**e, x.float())
    w, x = linear.small_binade_case(16, 256, 256, seed=4, device="cpu")
    small = x[:, 1:].float().abs()
    assert bool((x[:, 0] == 2**14).all()) and not w.q.float()[:, 0].any()
    assert bool((small >= 2**-17).all() and (small < 2**-14).all())
    assert torch.equal(x.to(torch.float16).float(), x.float())  # exact f16 (subnormals)


def test_fp8_gemv_checks_the_weight():
    from engine.quant import Fp8Weight, quantize_fp8

    x, fw = _bf16(2, 384), quantize_fp8(_bf16(130, 384))
    with pytest.raises(ValueError, match="takes an Fp8Weight"):
        linear.fp8_gemv(x, _bf16(130, 384))
    with pytest.raises(ValueError, match="block scales"):  # the K-major scale bug
        linear.fp8_gemv(x, Fp8Weight(fw.q, fw.scale.t().contiguous()))


_CFG = {"block_m": 16, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4,
        "swap_ab": True}


def _plan_rows():
    return [
        {"fp8": False, "m": 1, "n": 256, "k": 64, "impl": "gemv", "splits": 4,
         "us": {"library": 5.0, "gemv": 3.0}},
        {"fp8": False, "m": 8, "n": 256, "k": 64, "impl": "gemv", "splits": 1, "us": {},
         "kwarps": 2, "variant": 1},
        {"fp8": False, "m": 16, "n": 256, "k": 64, "impl": "library", "splits": 1},
        {"fp8": True, "m": 4, "n": 256, "k": 64, "impl": "triton", "splits": 1},
        {"fp8": True, "m": 2, "n": 256, "k": 64, "impl": "gemv", "splits": 2, "variant": 3,
         "us": {"gemv:v3:k0:s2": 4.0}},
        {"fp8": True, "m": 2, "n": 256, "k": 64, "impl": "triton_w8a8", "splits": 1,
         "config": _CFG, "us": {"triton_w8a8:x": 3.5}},  # faster than the m=2 gemv row
        {"fp8": True, "m": 8, "n": 256, "k": 64, "impl": "triton", "splits": 3,
         "config": _CFG, "us": {"triton:x": 2.0}},
        {"fp8": True, "m": 8, "n": 256, "k": 64, "impl": "triton_w8a8", "splits": 1,
         "config": _CFG, "us": {"triton_w8a8:x": 2.5}},  # slower than the m=8 triton row
    ]


def _picked(row):
    return row.impl, row.splits, row.kwarps, row.variant


def test_linear_plan_load_and_choose(tmp_path, caplog):
    import json

    assert linear.load_plan(tmp_path / "missing.json") is None
    assert linear.load_plan(None) is None
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "rows": _plan_rows()}))
    plan = linear.load_plan(path, device="test")
    assert plan is not None and len(plan.rows) == 8
    assert linear.load_plan(path, device=None) == plan  # no check
    # the nearest recorded M at or above m, same N and K; FP8 rows apart
    assert _picked(plan.choose(1, 256, 64, False)) == ("gemv", 4, 0, 0)
    assert _picked(plan.choose(2, 256, 64, False)) == ("gemv", 1, 2, 1)
    assert _picked(plan.choose(8, 256, 64, False)) == ("gemv", 1, 2, 1)
    assert plan.choose(9, 256, 64, False).impl == "library"
    assert plan.choose(17, 256, 64, False).impl == "library"  # above the table
    assert _picked(plan.choose(1, 256, 64, True)) == ("gemv", 2, 0, 3)
    assert plan.choose(3, 256, 64, True).impl == "triton"
    assert plan.choose(3, 256, 64, True).config is None
    row = plan.choose(5, 256, 64, True)
    assert (row.impl, row.splits) == ("triton", 3)
    assert row.triton_config().block_n == 128 and row.triton_config().swap_ab
    assert plan.choose(9, 256, 64, True).impl == "library"
    assert plan.choose(1, 512, 64, False).impl == "library"  # an unknown shape
    # W8A8 only when asked, and only where it was measured faster in the same bucket
    assert plan.choose(1, 256, 64, True, fp8_activations=True).impl == "triton_w8a8"
    assert plan.choose(2, 256, 64, False, fp8_activations=True).impl == "gemv"  # bf16
    assert plan.choose(8, 256, 64, True, fp8_activations=True).impl == "triton"
    assert plan.choose(3, 256, 64, True, fp8_activations=True).impl == "triton"
    assert plan.rows[0].best_us == 3.0 and plan.rows[1].best_us == float("inf")
    assert dict(plan.rows[0].us) == {"library": 5.0, "gemv": 3.0}
    path.write_text(json.dumps(plan.to_json()))  # a bare list of rows loads too
    assert linear.load_plan(path) == plan
    # a table recorded on another device kind is ignored, with a warning
    path.write_text(json.dumps({"device": "NVIDIA H200", "rows": _plan_rows()}))
    assert linear.load_plan(path, device="NVIDIA H200") == plan
    with caplog.at_level("WARNING", logger="engine.kernels.linear"):
        assert linear.load_plan(path, device="NVIDIA A100-SXM4-80GB") is None
    assert "recorded on 'NVIDIA H200'" in caplog.text
    if not torch.cuda.is_available():  # the default compares with the current GPU: none
        assert linear.load_plan(path) == plan


def test_tables_per_device_kind(tmp_path, monkeypatch, caplog):
    """The default table stands for the current GPU kind's: the committed file where it was
    recorded on that kind, else its sibling `<stem>.<slug>.json` (read where it exists,
    recorded and installed there otherwise); a kind with neither gets no plan, and a
    warning naming the file to record."""
    import json

    from engine.kernels import build

    assert build.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert build.device_slug("  NVIDIA  H200 ") == "nvidia-h200"
    base = tmp_path / "linear_table.json"
    h100 = tmp_path / "linear_table.nvidia-h100-80gb-hbm3.json"
    assert build.device_table(base, "NVIDIA H100 80GB HBM3") == base  # no base: the base
    base.write_text(json.dumps({"device": "NVIDIA H200", "rows": _plan_rows()}))
    assert build.device_table(base, "NVIDIA H200") == base
    assert build.device_table(base, None) == base  # a CPU: no comparison
    assert build.device_table(base, "NVIDIA H100 80GB HBM3") == h100  # not there yet
    monkeypatch.setattr(linear, "DEFAULT_TABLE", base)
    h200_plan = linear.load_plan(base, device="NVIDIA H200")
    assert h200_plan is not None
    with caplog.at_level("WARNING", logger="engine.kernels.linear"):
        assert linear.load_plan(base, device="NVIDIA H100 80GB HBM3") is None
    assert f"--out {h100}" in caplog.text
    rows = [r for r in _plan_rows() if not r["fp8"]]  # a different table for the H100
    h100.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "rows": rows}))
    assert build.device_table(base, "NVIDIA H100 80GB HBM3") == h100
    h100_plan = linear.load_plan(base, device="NVIDIA H100 80GB HBM3")
    assert h100_plan is not None and len(h100_plan.rows) == len(rows) != len(h200_plan.rows)
    assert linear.load_plan(base, device="NVIDIA H200") == h200_plan  # each its own
    # an explicit path is that file only (a sibling never stands in for it)
    other = tmp_path / "other.json"
    other.write_text(base.read_text())
    assert linear.load_plan(other, device="NVIDIA H100 80GB HBM3") is None
    # the codec's conv table the same way: no table for this kind -> cuDNN everywhere
    cbase = tmp_path / "codec_conv_table.json"
    cbase.write_text(cc.DEFAULT_TABLE.read_text())
    monkeypatch.setattr(cc, "DEFAULT_TABLE", cbase)
    assert cc.load_plan(cbase, device="NVIDIA H200").rows
    with caplog.at_level("WARNING", logger="engine.kernels.codec_conv"):
        assert cc.load_plan(cbase, device="NVIDIA H100 80GB HBM3") == cc.Plan()
    assert "codec_conv_table.nvidia-h100-80gb-hbm3.json is missing" in caplog.text
    (tmp_path / "codec_conv_table.nvidia-h100-80gb-hbm3.json").write_text(
        cbase.read_text().replace('"NVIDIA H200"', '"NVIDIA H100 80GB HBM3"'))
    assert cc.load_plan(cbase, device="NVIDIA H100 80GB HBM3").rows


@pytest.mark.parametrize("change,match", [
    ({"impl": "triton", "config": {**_CFG, "prescale": True}},
     "a dense .* config has no scales"),  # bf16 Triton rows: the dense GEMM's configs
    ({"impl": "triton_w8a8"}, "impl must be one of"),
    ({"impl": "cublas"}, "impl must be one of"),
    ({"splits": 0}, "splits must be"),
    ({"m": 0}, "m must be"),
    ({"fp8": 1}, "fp8 must be"),
    ({"us": {"gemv": "fast"}}, "us must map"),
    ({"n": None}, "n must be"),
    ({"kwarps": 3}, "kwarps must be"),
    ({"variant": 8}, "variant must be"),
    ({"variant": 2}, "variant 2 is for FP8 weights only"),
    ({"fp8": True, "variant": 7}, "variant 7 quantises the activations"),  # a 'gemv' row
    ({"fp8": True, "impl": "gemv_w8a8", "variant": 5}, "variant 7 quantises the activations"),
    ({"impl": "gemv_w8a8", "variant": 7}, "impl must be one of"),  # W8A8: FP8 rows only
    ({"fp8": True, "m": 32, "variant": 6}, "variant 6 stages x's rows"),  # at most 16 rows
    ({"config": _CFG}, "a config belongs to a Triton row"),
])
def test_linear_plan_rejects_bad_rows(tmp_path, change, match):
    import json

    rows = _plan_rows()
    rows[1] = {**rows[1], **change}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=f"row 1: {match}"):
        linear.load_plan(path)
    with pytest.raises(ValueError, match="two rows"):
        linear.LinearPlan.from_rows([*_plan_rows(), _plan_rows()[0]])
    with pytest.raises(ValueError, match="two W8A8 rows"):
        linear.LinearPlan.from_rows([*_plan_rows(), _plan_rows()[5]])
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        linear.load_plan(path)


@pytest.mark.parametrize("config,match", [
    ({**_CFG, "block_n": 96}, "block_n"),
    ({**_CFG, "block_k": 64}, "W8A8"),  # row 5 is a W8A8 row: block_k 128
    ({**_CFG, "warps": 4}, "unknown"),
    ({"block_m": 16}, "missing"),
    ({**_CFG, "swap_ab": 1}, "swap_ab"),
    ({**_CFG, "num_warps": 4.0}, "num_warps must be an int"),
    ([16, 64, 128], "must be an object"),
])
def test_linear_plan_checks_triton_configs(config, match):
    rows = _plan_rows()
    rows[5] = {**rows[5], "config": config}
    with pytest.raises(ValueError, match=f"row 5: .*{match}"):
        linear.LinearPlan.from_rows(rows)


def test_fp8_linears_run_their_dense_copy_where_the_plan_measured_bf16_faster():
    """`LinearPlan.dense_faster` compares a shape's FP8 and bf16 rows at m's bucket (past the
    largest recorded M, the largest); `make_linear` runs an `Fp8Weight` with a dense copy on
    that copy there when built with `dense` (a zero copy here shows which ran), and the FP8
    path elsewhere, without a copy, without `dense`, or for x in another dtype."""
    from engine.quant import Fp8Weight, fp8_linear_torch, quantize_fp8

    n, k = 256, 64
    rows = [{"fp8": fp8, "m": m, "n": n, "k": k, "impl": "library", "us": {"library": t}}
            for fp8, m, t in ((True, 1, 5.0), (False, 1, 8.0), (True, 16, 9.0),
                              (False, 16, 7.0), (True, 64, 12.0))]
    plan = linear.LinearPlan.from_rows(rows)
    assert [plan.dense_faster(m, n, k) for m in (1, 2, 16, 17, 64, 500)] == \
        [False, True, True, True, True, True]  # 17..: the bf16 rows end at 16
    assert not plan.dense_faster(16, n, 128) and not plan.dense_pays(n, 128)
    assert plan.dense_pays(n, k)
    w8 = linear.LinearPlan.from_rows([*rows, {"fp8": True, "m": 16, "n": n, "k": k,
                                              "impl": "triton_w8a8", "us": {"w8": 6.0}}])
    assert w8.dense_faster(16, n, k) and not w8.dense_faster(16, n, k, fp8_activations=True)
    fw = quantize_fp8(torch.randn(n, k))
    with_copy = Fp8Weight(fw.q, fw.scale, torch.zeros(n, k, dtype=torch.bfloat16))
    lin = linear.make_linear(plan, kernels=False, dense=True)
    for m in (1, 16, 40):
        x = torch.randn(m, k).to(torch.bfloat16)
        got = lin(x, with_copy)
        if plan.dense_faster(m, n, k):
            assert torch.equal(got, torch.zeros(m, n, dtype=torch.bfloat16))
        else:
            assert torch.equal(got, fp8_linear_torch(x, fw))
        assert torch.equal(lin(x, fw), fp8_linear_torch(x, fw))  # no copy: FP8 always
    x = torch.ones(40, k, dtype=torch.bfloat16)
    for other in (linear.make_linear(None, kernels=False, dense=True),  # no table
                  linear.make_linear(plan, kernels=False)):  # ops that take no copies
        assert not other(x, with_copy).eq(0).all()
    # x in another dtype than the copy: the FP8 path (which takes any float x)
    assert torch.equal(lin(x.float(), with_copy), fp8_linear_torch(x.float(), fw))


def test_one_row_split_gives_way_to_a_one_launch_candidate_within_the_margin():
    """At M = 1 a K-split csrc row is replaced by its fastest recorded one-launch candidate
    within ONE_ROW_SPLIT_MARGIN_US (its reduce launch bought nothing in the step there); a
    bigger lead keeps the split, and rows of more than one row keep theirs."""
    def row(m, us):  # type: ignore[no-untyped-def]
        return {"fp8": True, "m": m, "n": 2560, "k": 9728, "impl": "gemv", "splits": 2,
                "kwarps": 8, "variant": 5, "us": us}

    near = {"gemv:v5:k8:s2": 11.0, "gemv:v4:k8:s1": 11.6, "gemv:v0:k4:s1": 11.8}
    far = {"gemv:v5:k8:s2": 11.0, "gemv:v4:k8:s1": 12.2}
    plan = linear.LinearPlan.from_rows([row(1, near), row(2, near)])
    got = plan.choose(1, 2560, 9728, True)
    assert (got.splits, got.variant, got.kwarps) == (1, 4, 8)
    assert plan.choose(2, 2560, 9728, True).splits == 2  # two rows: the split stays
    assert linear.LinearPlan.from_rows([row(1, far)]).choose(1, 2560, 9728, True).splits == 2
    assert linear.ONE_ROW_SPLIT_MARGIN_US == 1.0


def test_rowwise_w8a8_rows_are_chosen_where_faster_and_run_the_rowwise_copy():
    """A "rowwise_w8a8" row (FP8 only) is the shape's W8A8 row: taken with `fp8_activations`
    where it beat the weight-only row of its bucket and, past the table's largest M, as the
    largest W8A8 row (a GEMM runs any M); `rowwise_pays` says where the engine needs the
    copies (not where a dense copy is faster still); `resolve` runs the rowwise GEMM on a
    weight's rowwise copy and the weight-only choice on a weight without one."""
    from engine.quant import Fp8Weight, fp8_linear_torch, fp8_rowwise_linear, quantize_fp8
    from engine.quant import rowwise_fp8 as requant

    n, k = 256, 64
    rows = [{"fp8": True, "m": 16, "n": n, "k": k, "impl": "library", "us": {"library": 9.0}},
            {"fp8": True, "m": 64, "n": n, "k": k, "impl": "library", "us": {"library": 20.0}},
            {"fp8": False, "m": 64, "n": n, "k": k, "impl": "library", "us": {"library": 12.0}},
            {"fp8": True, "m": 16, "n": n, "k": k, "impl": "rowwise_w8a8",
             "us": {"rowwise_w8a8": 10.0, "triton_w8a8:x:k1": 11.0}},
            {"fp8": True, "m": 64, "n": n, "k": k, "impl": "rowwise_w8a8",
             "us": {"rowwise_w8a8": 8.0}}]
    plan = linear.LinearPlan.from_rows(rows)
    assert plan.choose(16, n, k, True, True).impl == "library"  # the weight-only row won
    assert plan.choose(64, n, k, True, True).impl == "rowwise_w8a8"
    assert plan.choose(64, n, k, True).impl == "library"  # W8A8 only when asked
    assert plan.choose(200, n, k, True, True).impl == "rowwise_w8a8"  # past the table
    assert plan.choose(200, n, k, True).impl == "library"
    assert plan.dense_faster(64, n, k) and not plan.dense_faster(64, n, k, True)
    assert plan.dense_pays(n, k) and not plan.dense_pays(n, k, True)
    assert plan.rowwise_pays(n, k) and not plan.rowwise_pays(n, 128)
    slower = linear.LinearPlan.from_rows([*rows[:3], {**rows[4], "us": {"rowwise_w8a8": 15.0}}])
    assert not slower.rowwise_pays(n, k)  # the dense copy beats it at 64: no rowwise copy
    assert slower.rowwise_pays(n, k, dense=False)  # unless no dense copies are made
    with pytest.raises(ValueError, match="impl must be one of"):
        linear.LinearPlan.from_rows([{**rows[3], "fp8": False}])
    fw = quantize_fp8(torch.randn(n, k))
    rq, rs = requant(fw)
    with_copy = Fp8Weight(fw.q, fw.scale, None, (rq, rs))
    fn = linear.resolve(plan, False, 64, n, k, True, torch.bfloat16, True, fp8_activations=True)
    x = torch.randn(64, k).to(torch.bfloat16)
    assert torch.equal(fn(x, with_copy), fp8_rowwise_linear(x, rq, rs))
    assert torch.equal(fn(x, fw), fp8_linear_torch(x, fw))  # no copy: the weight-only path
    # the engine's make_linear on CUDA takes the rowwise GEMM there (CPU: the references)
    fn_cpu = linear.make_linear(plan, kernels=False, fp8_activations=True)
    assert torch.equal(fn_cpu(x, with_copy), fp8_linear_torch(x, fw))


def test_epilogue_kernels_decline_what_the_plan_runs_as_w8a8(monkeypatch):
    """With `fp8_activations`, csrc's SwiGLU / residual epilogues and normed / attention
    prologues decline an FP8 call at the M where the plan runs that linear as a W8A8 GEMM
    (so the linear runs it, its add / norm / silu * mul their own launches), and take their
    usual decision elsewhere and without the option."""
    from engine.quant import Fp8Weight, quantize_fp8, rowwise_fp8

    n, k = 256, 128
    rows = [{"fp8": True, "m": 16, "n": n, "k": k, "impl": "gemv", "splits": 1, "kwarps": 4,
             "variant": 0, "us": {"gemv:v0:k4:s1": 10.0}},
            {"fp8": True, "m": 16, "n": n, "k": k, "impl": "rowwise_w8a8",
             "us": {"rowwise_w8a8": 6.0}}]
    plan = linear.LinearPlan.from_rows(rows)
    bare = quantize_fp8(torch.randn(n, k))
    w = Fp8Weight(bare.q, bare.scale, None, rowwise_fp8(bare))
    x = torch.randn(16, k).to(torch.bfloat16)
    assert linear._w8a8_takes(plan, x, w, True)
    assert not linear._w8a8_takes(plan, x, w, False)
    # without its rowwise copy the linear runs the weight-only path: the kernels keep it
    assert not linear._w8a8_takes(plan, x, bare, True)
    assert not linear._w8a8_takes(plan, x, torch.randn(n, k), True)  # a bf16 weight
    assert not linear._w8a8_takes(None, x, w, True)
    looked: list[str] = []  # the wrappers' own plan lookups, made only for calls they keep
    real_gemv_row, real_lookup = linear._gemv_row, linear._prologue_lookup
    monkeypatch.setattr(linear, "_gemv_row",
                        lambda *a, **kw: looked.append("row") or real_gemv_row(*a, **kw))

    def lookup(*a, **kw):  # type: ignore[no-untyped-def]
        inner = real_lookup(*a, **kw)
        return lambda *b: looked.append("prologue") or inner(*b)

    monkeypatch.setattr(linear, "_prologue_lookup", lookup)
    r = torch.zeros(16, n, dtype=torch.bfloat16)
    for act in (False, True):
        looked.clear()
        swiglu = linear.make_swiglu(plan, kernels=True, fp8_activations=act)
        residual = linear.make_residual(plan, kernels=True, fp8_activations=act)
        normed = linear.make_normed(plan, kernels=True, max_m_fp8=16, fp8_activations=act)
        got = [swiglu(x, w), residual(x, w, r),
               normed(x, torch.ones(k, dtype=torch.bfloat16), 1e-6, w, False)]
        assert got == [None, None, None]  # (on a CPU nothing takes it either way)
        assert looked == ([] if act else ["row", "row", "prologue"]), (act, looked)


def test_gemv_w8a8_rows_run_variant_7_only_with_fp8_activations(monkeypatch):
    """A "gemv_w8a8" row (variant 7, FP8 only) is its shape's W8A8 row: chosen with
    `fp8_activations` where it beat the weight-only row, never without; the epilogues then
    decline the call; `resolve` runs csrc's variant 7 with the row's splits and kwarps where
    the kernel takes the shape (faked here: the call a CUDA machine would make), else the
    library path; its recorded labels are never a weight-only row's candidates."""
    from engine.quant import quantize_fp8

    n, k = 256, 128
    rows = [{"fp8": True, "m": 2, "n": n, "k": k, "impl": "gemv", "splits": 1, "kwarps": 4,
             "variant": 5, "us": {"gemv:v5:k4:s1": 10.0}},
            {"fp8": True, "m": 2, "n": n, "k": k, "impl": "gemv_w8a8", "splits": 2,
             "kwarps": 2, "variant": 7, "us": {"gemv_w8a8:v7:k2:s2": 7.0}}]
    plan = linear.LinearPlan.from_rows(rows)
    assert plan.choose(2, n, k, True).impl == "gemv"
    row = plan.choose(2, n, k, True, True)
    assert (row.impl, row.variant, row.splits, row.kwarps) == ("gemv_w8a8", 7, 2, 2)
    assert [c[1] for c in plan.rows[1].gemv_candidates()] == []
    assert linear.LinearPlan.from_rows([r.to_json() for r in plan.rows]) == plan
    w = quantize_fp8(torch.randn(n, k))
    x = torch.randn(2, k).to(torch.bfloat16)
    assert linear._w8a8_takes(plan, x, w, True) and not linear._w8a8_takes(plan, x, w, False)
    calls = []
    monkeypatch.setattr(linear, "supports", lambda m, n, k, fp8, variant=0: True)
    monkeypatch.setattr(linear, "_problem", lambda *a: None)
    monkeypatch.setattr(linear, "_run", lambda x, wq, scale, splits, kwarps, variant, **kw:
                        calls.append((splits, kwarps, variant)) or x.new_zeros(2, n))
    fn = linear.resolve(plan, True, 2, n, k, True, torch.bfloat16, True, fp8_activations=True)
    fn(x, w)
    assert calls == [(2, 2, 7)]
    off = linear.resolve(plan, True, 2, n, k, True, torch.bfloat16, True)  # weight-only row
    off(x, w)
    assert calls[-1] == (1, 4, 5)
    assert linear.resolve(plan, False, 2, n, k, True, torch.bfloat16, False,
                          fp8_activations=True) is linear.fp8_linear_torch  # CPU: library


def test_linear_bench_merges_a_partial_sweeps_w8a8_rows_into_a_table():
    """`linear_bench --w8a8-into TABLE`: the sweep's W8A8 rows replace TABLE's of the same
    shape and M, its weight-only rows stay; `--into TABLE`: its rows of both kinds do; a
    table from another device is refused."""
    from bench_latency.linear_bench import merge_into, merge_w8a8

    table = {"device": "GPU A", "rows": _plan_rows()}
    new = [linear.PlanRow(True, 2, 256, 64, "gemv_w8a8", 2, (("gemv_w8a8:v7:k2:s2", 3.0),), 2, 7),
           linear.PlanRow(True, 64, 256, 64, "gemv_w8a8", 1, (("gemv_w8a8:v7:k1:s1", 9.0),), 1, 7),
           linear.PlanRow(True, 2, 256, 64, "gemv", 1, (("gemv:v5:k1:s1", 1.0),), 1, 5)]
    merged = merge_w8a8(table, new, "GPU A")
    plan = linear.LinearPlan.from_rows(merged["rows"])
    assert plan.choose(2, 256, 64, True, True).impl == "gemv_w8a8"  # replaced triton_w8a8
    assert plan.choose(2, 256, 64, True).variant == 3  # the table's weight-only row kept
    assert plan.choose(64, 256, 64, True, True).impl == "gemv_w8a8"  # added
    assert len(merged["rows"]) == len(table["rows"]) + 1 and merged["device"] == "GPU A"
    with pytest.raises(SystemExit, match="recorded on 'GPU A'"):
        merge_w8a8(table, new, "GPU B")
    # --into: a partial sweep's rows of both kinds replace the table's of the same shape and M
    merged = merge_into(table, new, "GPU A")
    plan = linear.LinearPlan.from_rows(merged["rows"])
    assert plan.choose(2, 256, 64, True).variant == 5  # the weight-only row replaced too
    assert plan.choose(2, 256, 64, True, True).impl == "gemv"  # faster than its W8A8 row
    assert sorted(d["impl"] for d in merged["rows"] if d["fp8"] and d["m"] == 2) == [
        "gemv", "gemv_w8a8"]  # the sweep's two rows, the table's two gone
    assert plan.choose(1, 256, 64, False).impl == "gemv"  # untouched rows kept
    assert len(merged["rows"]) == len(table["rows"]) + 1
    with pytest.raises(SystemExit, match="--into: that table was recorded on 'GPU A'"):
        merge_into(table, new, "GPU B")


def test_rowwise_copies_of_a_packed_ffn_stay_one_gemm():
    """fusion.add_rowwise_copies gives the FP8 linears whose shape pays their rowwise copy,
    a packed W1|W3 as one buffer (its halves' copies adjacent: `packed` hands the pair one
    rowwise weight), each half's values those of its own `rowwise_fp8`; layers that do not
    pay get none."""
    from engine.fusion import add_rowwise_copies, pack_ffn, packed
    from engine.loader import load_bundle
    from engine.quant import Fp8Linear, rowwise_fp8

    m = load_bundle("tiny", device="cpu", dtype="fp8").model
    pack_ffn(m)
    ff = m.layers[0].feed_forward
    both = packed(ff.w1.weight, ff.w3.weight)
    assert both is not None and both.rowwise is None
    skip = tuple(ff.w2.qweight.shape)
    added = add_rowwise_copies(m, pays=lambda n, k: (n, k) != skip)
    assert added > 0
    both = packed(ff.w1.weight, ff.w3.weight)
    assert both is not None and both.rowwise is not None
    want = rowwise_fp8(ff.w1.weight)
    assert torch.equal(ff.w1.rowwise_q.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(ff.w1.rowwise_scale, want[1])
    assert both.rowwise[0].shape[0] == 2 * ff.w1.qweight.shape[0]
    assert ff.w2.rowwise_q is None  # its shape does not pay
    fp8 = [mod for mod in m.modules() if isinstance(mod, Fp8Linear)]
    assert all((mod.rowwise_q is None) == (tuple(mod.qweight.shape) == skip) for mod in fp8)
    assert add_rowwise_copies(m) == sum(mod.qweight.numel() + 4 * mod.qweight.shape[0]
                                        for mod in fp8 if tuple(mod.qweight.shape) == skip)
    from engine.config import preset
    from engine.model import DualAR
    from engine.quant import quantize_model

    late = DualAR(preset("tiny")).to(torch.bfloat16)  # unpacked: copies first, packing after
    quantize_model(late)
    add_rowwise_copies(late)
    assert packed(late.layers[0].feed_forward.w1.weight,
                  late.layers[0].feed_forward.w3.weight) is None
    pack_ffn(late)
    lf = late.layers[0].feed_forward
    lb = packed(lf.w1.weight, lf.w3.weight)
    assert lb is not None and lb.rowwise is not None
    assert torch.equal(lb.rowwise[1], rowwise_fp8(lb)[1])


def test_make_linear_on_cpu_runs_the_references(monkeypatch):
    """On a CPU every shape takes the library / reference path whatever the plan says, and
    the choice is made once per shape (one dict lookup per call after that)."""
    import torch.nn.functional as F

    from engine.quant import fp8_linear_torch, quantize_fp8

    plan = linear.LinearPlan.from_rows(_plan_rows())
    calls = []
    real = linear.resolve
    monkeypatch.setattr(linear, "resolve",
                        lambda *a, **kw: calls.append(a) or real(*a, **kw))
    fn = linear.make_linear(plan, kernels=True)
    x, w = _bf16(1, 64), _bf16(256, 64, seed=1)
    fw = quantize_fp8(w)
    for _ in range(3):
        assert torch.equal(fn(x, w), F.linear(x, w))
        assert torch.equal(fn(x, fw), fp8_linear_torch(x, fw))
    assert torch.equal(fn(x.float(), w.float()), F.linear(x.float(), w.float()))  # CPU fp32
    assert torch.equal(fn(x[None].expand(3, 1, 64), w), F.linear(x[None].expand(3, 1, 64), w))
    assert [(a[2], a[5]) for a in calls] == [(1, False), (1, True), (1, False), (3, False)]
    fn8 = linear.make_linear(plan, kernels=True, fp8_activations=True)  # CPU: still exact
    assert torch.equal(fn8(_bf16(2, 64), fw), fp8_linear_torch(_bf16(2, 64), fw))


def test_linear_resolve_follows_the_plan(monkeypatch):
    """The function picked per shape: the kernel where the plan says gemv and it can run
    (CUDA, bf16 x, kernels on, a supported shape), the library path otherwise; FP8's library
    path is the Triton kernel where it imports (on CUDA), else the reference; a Triton row
    runs the Triton kernel with its config and split; W8A8 only when asked."""
    import functools
    import types

    import torch.nn.functional as F

    from engine.kernels import fp8_triton
    from engine.quant import fp8_linear_torch

    plan = linear.LinearPlan.from_rows(_plan_rows())
    monkeypatch.setattr(linear, "supports", lambda m, n, k, fp8, variant=0: m <= 64)
    sentinel = object()
    monkeypatch.setattr(linear, "triton_fp8", lambda: sentinel)
    fake = types.SimpleNamespace(fp8_linear_triton=lambda x, w, **kw: None,
                                 fp8_linear_triton_w8a8=lambda x, w, **kw: None)
    monkeypatch.setattr(linear, "_triton_module", lambda: fake)
    bf, f32 = torch.bfloat16, torch.float32
    picked = linear.resolve(plan, True, 1, 256, 64, False, bf, True)
    assert picked is not F.linear and callable(picked)
    assert linear.resolve(plan, False, 1, 256, 64, False, bf, True) is F.linear
    assert linear.resolve(plan, True, 1, 256, 64, False, bf, False) is F.linear
    assert linear.resolve(plan, True, 1, 256, 64, False, f32, True) is F.linear
    assert linear.resolve(plan, True, 16, 256, 64, False, bf, True) is F.linear
    assert linear.resolve(None, True, 1, 256, 64, False, bf, True) is F.linear
    assert linear.resolve(plan, True, 3, 256, 64, True, bf, True) is sentinel  # no config
    assert linear.resolve(plan, True, 9, 256, 64, True, bf, True) is sentinel  # "library"
    assert linear.resolve(plan, True, 9, 256, 64, True, bf, False) is fp8_linear_torch
    assert linear.resolve(plan, True, 9, 256, 64, True, f32, True) is fp8_linear_torch
    tri = linear.resolve(plan, True, 5, 256, 64, True, bf, True)  # "triton" with a config
    assert isinstance(tri, functools.partial) and tri.func is fake.fp8_linear_triton
    assert tri.keywords == {"config": fp8_triton.Config.from_json(_CFG), "split_k": 3}
    assert linear.resolve(plan, False, 5, 256, 64, True, bf, True).func is tri.func
    w8 = linear.resolve(plan, True, 1, 256, 64, True, bf, True, fp8_activations=True)
    assert w8.func is fake.fp8_linear_triton_w8a8 and w8.keywords["split_k"] == 1
    assert not isinstance(linear.resolve(plan, True, 1, 256, 64, True, bf, True),
                          functools.partial)  # gemv
    monkeypatch.setattr(linear, "triton_fp8", lambda: None)
    monkeypatch.setattr(linear, "_triton_module", lambda: None)
    assert linear.resolve(plan, True, 3, 256, 64, True, bf, True) is fp8_linear_torch
    assert linear.resolve(plan, True, 5, 256, 64, True, bf, True) is fp8_linear_torch
    # no Triton: a W8A8 choice falls back to the exact library path
    assert linear.resolve(plan, False, 1, 256, 64, True, bf, True,
                          fp8_activations=True) is fp8_linear_torch
    fp8_kernel = linear.resolve(plan, True, 1, 256, 64, True, bf, True)
    assert fp8_kernel not in (fp8_linear_torch, F.linear)
    # a call whose x breaks the kernel's layout contract takes the library path instead
    x, w = _wide(1, 72, 4, 64), _bf16(256, 64, seed=1)
    assert torch.equal(picked(x, w), F.linear(x, w))


def test_linear_resolve_runs_bf16_triton_rows_on_the_dense_gemm(monkeypatch):
    """A bf16 row that chose the Triton GEMM runs `dense_linear_triton` with its config and
    split on CUDA for bf16 / fp16 x where the call meets its contract, F.linear where it does
    not (a strided weight, another dtype) and wherever Triton cannot run or the row has no
    config; an FP8 weight's dense copy follows the bf16 row at M where the plan measured it
    faster."""
    import torch.nn.functional as F

    from engine.kernels import fp8_triton

    n, k = 256, 64
    rows = [{"fp8": False, "m": 32, "n": n, "k": k, "impl": "triton", "splits": 2,
             "config": {**_CFG, "block_m": 32}, "us": {"library": 9.0, "triton:x": 7.0}},
            {"fp8": False, "m": 64, "n": n, "k": k, "impl": "triton", "splits": 1,
             "us": {"triton:x": 7.0}},  # no config: the library path
            {"fp8": True, "m": 32, "n": n, "k": k, "impl": "library", "us": {"library": 8.0}}]
    plan = linear.LinearPlan.from_rows(rows)
    assert plan.dense_faster(32, n, k)  # 7.0 (the dense GEMM) against FP8's 8.0
    calls = []

    def fake_dense(x, w, **kw):  # the real wrapper's contract check, then a marked product
        fp8_triton.check_dense(x, w, kw["config"], kw["split_k"])
        calls.append(kw)
        return F.linear(x, w) + 1  # tells the paths apart

    monkeypatch.setattr(fp8_triton, "dense_linear_triton", fake_dense)
    monkeypatch.setattr(linear, "_triton_module", lambda: fp8_triton)
    bf = torch.bfloat16
    fn = linear.resolve(plan, True, 20, n, k, False, bf, True)
    x, w = torch.randn(20, k).to(bf), torch.randn(n, k).to(bf)
    assert torch.equal(fn(x, w), F.linear(x, w) + 1)
    assert calls == [{"config": fp8_triton.Config.from_json({**_CFG, "block_m": 32}),
                      "split_k": 2}]
    wide = torch.randn(n, 2 * k).to(bf)[:, :k]  # a strided weight: not the kernel's contract
    assert torch.equal(fn(x, wide), F.linear(x, wide)) and len(calls) == 1
    assert linear.resolve(plan, True, 20, n, k, False, bf, False) is F.linear  # CPU
    assert linear.resolve(plan, True, 20, n, k, False, torch.float32, True) is F.linear
    assert linear.resolve(plan, True, 64, n, k, False, bf, True) is F.linear  # no config
    monkeypatch.setattr(linear, "_triton_module", lambda: None)
    assert linear.resolve(plan, True, 20, n, k, False, bf, True) is F.linear


def test_swiglu_fallback_contract_and_dispatch():
    """gemv_swiglu off the kernel is the unfused reference (F.linear over [W1; W3], then
    F.silu(gate) * up) and checks its contract; make_swiglu answers None (the caller runs
    the linear and silu_mul) wherever the kernel does not take the call (on CUDA it picks
    per shape from the plan: test_swiglu_kernel_in_ops_and_graph_replay); Ops.swiglu uses
    its answer or falls back."""
    import torch.nn.functional as F

    from engine import functional
    from engine.ops import Ops
    from engine.quant import fp8_linear_torch, quantize_fp8

    x, w1, w3 = _bf16(3, 64), _bf16(128, 64, seed=1), _bf16(128, 64, seed=2)
    w13 = torch.cat([w1, w3])
    want = F.silu(F.linear(x, w1)) * F.linear(x, w3)
    assert torch.equal(linear.swiglu_reference(x, w13), want)
    assert torch.equal(linear.gemv_swiglu(x, w13), want)
    assert torch.equal(linear.gemv_swiglu(x, w13, splits=3, kwarps=2, variant=1), want)
    assert linear.gemv_swiglu(x[None], w13).shape == (1, 3, 128)
    for bad, match in ((w13[:-1], "even row count"),
                       (quantize_fp8(_bf16(128, 64)), "multiple of 128"),
                       (_bf16(64, 256).t(), "contiguous"),
                       (_bf16(256, 48), "last dim must be K")):
        with pytest.raises(ValueError, match=match):
            linear.gemv_swiglu(x, bad)
    with pytest.raises(ValueError, match="variant 2 converts FP8"):
        linear.gemv_swiglu(x, w13, variant=2)
    # FP8 [W1; W3] (I a multiple of 128): the dequantising linear, then silu * up
    f13 = quantize_fp8(w13)
    hf = fp8_linear_torch(x, f13)
    assert torch.equal(linear.gemv_swiglu(x, f13), F.silu(hf[:, :128]) * hf[:, 128:])
    with pytest.raises(ValueError, match="FP8 weights runs in variant 0"):
        linear.gemv_swiglu(x, f13, variant=1)
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear.gemv_swiglu(_bf16(17, 64), f13)

    plan = linear.LinearPlan.from_rows(_plan_rows())  # n = 256, k = 64: gemv at m <= 8
    fn = linear.make_swiglu(plan, kernels=True)
    assert fn(_bf16(1, 64), w13) is None  # CPU tensors: never the kernel (tested on CUDA)
    assert fn(_bf16(1, 64), quantize_fp8(w13)) is None
    assert linear.make_swiglu(None, kernels=True)(_bf16(1, 64), w13) is None

    # Ops.swiglu: the kernel's answer when it gives one, else the linear and silu_mul
    a = torch.cat([w1, w3])  # packed: W1 and W3 consecutive rows of one buffer
    p1, p3 = a[:128], a[128:]
    marker = torch.full((3, 128), 7.0, dtype=torch.bfloat16)
    ops = Ops(packed_ffn=True, swiglu_kernel=lambda x, w: marker)
    assert ops.swiglu(x, p1, p3) is marker
    ops = Ops(packed_ffn=True, swiglu_kernel=lambda x, w: None)
    torch.testing.assert_close(ops.swiglu(x, p1, p3), functional.silu_mul(
        F.linear(x, w1), F.linear(x, w3)), rtol=0, atol=0)
    # unpacked W1, W3 never reach the kernel
    ops = Ops(packed_ffn=True, swiglu_kernel=lambda x, w: pytest.fail("not packed"))
    assert torch.equal(ops.swiglu(x, w1, w3), want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_linear_bench_needs_a_gpu(capsys):
    from bench_latency import linear_bench

    assert linear_bench.main([]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_linear_bench_launches_and_splits_as_the_engine():
    """`--pdl auto` times FP8 weights with PDL and bf16 plainly (the engine's pdl=auto); a
    Triton config is timed at its automatic K split and, from TRITON_SPLIT_SWEEP_M rows on,
    at every distinct split of TRITON_SPLITS that launches."""
    from bench_latency import linear_bench as lb
    from engine.kernels import fp8_triton as ft

    assert (lb.pdl_mode("auto", True), lb.pdl_mode("auto", False)) == (1, 0)
    assert (lb.pdl_mode("0", True), lb.pdl_mode("3", False)) == (0, 3)
    cfg = ft.Config(64, 128, 128, 8, 4, swap_ab=True, prescale=True)
    few = lb._triton_splits(ft, 1, 2560, 9728, cfg, 132)
    assert few == [ft.launch_split(1, 2560, 9728, cfg, 0, 132)]
    many = lb._triton_splits(ft, 64, 2560, 9728, cfg, 132)
    assert many[0] == ft.launch_split(64, 2560, 9728, cfg, 0, 132)
    assert len(many) == len(set(many)) and set(many) >= {1, 2, 3, 4, 6, 8}


# S2-Pro's decode shapes (wqkv, wo, w2, semantic logits with N = 4097) and odd ones: N = 300
# and 17 (partial 16-row tiles), K = 2576 (a partial K chunk: 2576 % 32 = 2576 % 128 = 16),
# K = 48 (one partial chunk only)
_LINEAR_SHAPES = [(6144, 2560), (2560, 4096), (2560, 9728), (4097, 2560), (300, 2560),
                  (300, 9728), (17, 2576), (40, 48)]
# every MMA n-tile template (M <= 8, 16, 32, 64) and its edges
_LINEAR_MS = [1, 2, 3, 4, 7, 8, 9, 16, 17, 32, 33, 64]


def _assert_linear_close(got, x, wf):
    """A kernel result against the float32 product. The kernel accumulates in float32 (in its
    own order: split-K, MMA k-steps) and rounds once to bf16, so it may differ from the exact
    product by half a bf16 ulp (2^-8 relative at worst) plus float32 summation error, bounded
    here by 2^-14 of sum_k |x w| (a float32 ordering error is ~K 2^-24 of that at worst)."""
    ref = x.float() @ wf.t()
    bound = 2**-8 * ref.abs() + 2**-14 * (x.float().abs() @ wf.abs().t())
    err = (got.float() - ref).abs()
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert bool(torch.isfinite(got).all())
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, " \
        f"worst err/bound {float((err / bound).max()):.3g}"


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _variants(fp8, m=1, k=16):
    """The csrc variants this GPU runs (3 and 6: sm_89+) for bf16 or FP8 weights, at m rows
    of K (6: rows it can stage): the weight-only ones (7, W8A8, has tests of its own)."""
    vs = tuple(v for v in linear.VARIANTS if v != linear.QUANT_VARIANT) if fp8 else (0, 1, 4, 5)
    return tuple(v for v in vs
                 if (v not in (3, 6) or torch.cuda.get_device_capability() >= (8, 9))
                 and (v != 6 or linear._stages(m, k)))


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("N,K", _LINEAR_SHAPES)
@pytest.mark.parametrize("M", _LINEAR_MS)
def test_gemv_cuda_kernel_matches_reference(N, K, M):
    assert extension_available(), "the CUDA extension did not build"
    assert linear.supports(M, N, K, False)
    w = (_bf16(N, K, seed=N + K, device="cuda").float() / K**0.5).to(torch.bfloat16)
    x = _bf16(M, K, seed=M, device="cuda")
    wf = w.float()
    for v in _variants(False):
        for splits in (0, 1, 2, 5, 64):  # 64 > chunks for most K: empty ranges write zeros
            _assert_linear_close(linear.gemv(x, w, splits=splits, variant=v), x, wf)
        for kwarps in (1, 2, 4, 8):  # 8, 4, 2, 1 row tiles per block
            _assert_linear_close(linear.gemv(x, w, splits=1, kwarps=kwarps, variant=v), x, wf)
        _assert_linear_close(linear.gemv(x, w, splits=3, kwarps=2, variant=v), x, wf)


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("N,K", _LINEAR_SHAPES)
@pytest.mark.parametrize("M", _LINEAR_MS)
def test_fp8_gemv_cuda_kernel_matches_reference(N, K, M):
    from engine.quant import dequantize_fp8, quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    # rows of very different magnitudes: scales vary by row block and K block
    w = _bf16(N, K, seed=N + K, device="cuda").float()
    w = w * torch.logspace(-3, 3, N, device="cuda")[:, None] / K**0.5
    fw = quantize_fp8(w)
    x = _bf16(M, K, seed=M, device="cuda")
    wf = dequantize_fp8(fw)  # the exact weight the FP8 values stand for
    for v in _variants(True, M, K):
        try:
            for splits in (0, 1, 3, 64):
                _assert_linear_close(linear.fp8_gemv(x, fw, splits=splits, variant=v), x, wf)
            for kwarps in (1, 2, 4, 8):
                _assert_linear_close(linear.fp8_gemv(x, fw, splits=1, kwarps=kwarps, variant=v),
                                     x, wf)
            _assert_linear_close(linear.fp8_gemv(x, fw, splits=2, kwarps=4, variant=v), x, wf)
        except AssertionError as e:
            raise AssertionError(f"variant {v}: {e}") from None


@pytest.mark.cuda
@_cuda
def test_fp8_gemv_cuda_every_e4m3_value():
    """All 254 finite e4m3 codes (subnormals, both zeros, +-448) through the kernel's
    bit-level e4m3 -> bf16 conversion, with scales far from 1."""
    from engine.quant import Fp8Weight, dequantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    g = torch.Generator().manual_seed(5)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes[torch.randint(0, len(codes), (256, 1024), generator=g)]
    q[0, :254] = codes  # every code at least once
    scale = 2.0 ** torch.randint(-20, 10, (2, 8), generator=g).float()
    fw = Fp8Weight(q.view(torch.float8_e4m3fn).cuda(), scale.cuda())
    x = _bf16(5, 1024, seed=6, device="cuda")
    one = torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")
    one[0, :254] = 1  # row 0 sums every code once, scale 2^e: exactly representable terms
    want = dequantize_fp8(fw)[0, :254].double().sum().float()
    for v in _variants(True):
        _assert_linear_close(linear.fp8_gemv(x, fw, splits=1, variant=v), x, dequantize_fp8(fw))
        got = linear.fp8_gemv(one, fw, splits=1, variant=v)[0, 0].float()
        torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=2**-8, atol=0)
        # each positive code once against 1, the rest 0: a sum with no cancellation
        pos = one.clone()
        pos[0, :254] = (q[0, :254] < 0x80).to(torch.bfloat16).cuda()
        got = linear.fp8_gemv(pos, fw, splits=1, variant=v)[0, 0].float()
        ref = (dequantize_fp8(fw)[0].double() * pos[0].double()).sum().float()
        torch.testing.assert_close(got, ref.to(torch.bfloat16).float(), rtol=2**-8, atol=0)


@pytest.mark.cuda
@_cuda
def test_fp8_gemv_cuda_subnormal_products():
    """Subnormal e4m3 weights (codes 1-7) times small x (2^-10): the products are float32
    subnormals inside variant 2's MMA (2^-120 times the weights). Variants 0, 1, 3 must be
    exact to the usual bound; variant 2 is where the tensor cores keep subnormal inputs and
    products (else linear_bench's probe leaves it out: an expected failure here)."""
    from engine.quant import dequantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    fw, x = linear.subnormal_case(300, 1024, 9, seed=7)
    for v in _variants(True):
        try:
            _assert_linear_close(linear.fp8_gemv(x, fw, splits=1, variant=v), x,
                                 dequantize_fp8(fw))
        except AssertionError as e:
            if v == 2:
                pytest.xfail(f"variant 2 is not exact on this GPU (subnormals flushed): {e}")
            raise AssertionError(f"variant {v}: {e}") from None


@pytest.mark.cuda
@_cuda
def test_fp8_gemv_cuda_variant3_saturates_large_x():
    """Variant 3 rounds x to f16: |x| > 65504 saturates (a finite, wrong result); the
    bf16-exact variants keep it."""
    from engine.quant import dequantize_fp8, quantize_fp8

    if 3 not in _variants(True):
        pytest.skip("variant 3 needs sm_89+")
    fw = quantize_fp8(_bf16(256, 512, seed=2, device="cuda"))
    x = _bf16(2, 512, seed=3, device="cuda")
    x[0, 5] = 2.0**20
    got = linear.fp8_gemv(x, fw, variant=3)
    assert bool(torch.isfinite(got).all())
    _assert_linear_close(got[1:], x[1:], dequantize_fp8(fw))  # the ordinary row: exact
    _assert_linear_close(linear.fp8_gemv(x, fw, variant=1), x, dequantize_fp8(fw))


@pytest.mark.cuda
@_cuda
def test_linear_cuda_strided_rows_leading_dims_and_dispatch():
    import torch.nn.functional as F

    from engine.quant import fp8_linear_torch, quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    N, K = 4097, 2560
    w = (_bf16(N, K, seed=1, device="cuda").float() / K**0.5).to(torch.bfloat16)
    fw = quantize_fp8(w)
    wide = _bf16(6, K + 64, seed=2, device="cuda")
    x = wide[:, 32:32 + K]  # rows 5,248 bytes apart, starting 64 bytes in
    for got in (linear.gemv(x, w, splits=2), linear.gemv(x.contiguous(), w, splits=2)):
        _assert_linear_close(got, x, w.float())
    x3 = wide.view(2, 3, K + 64)[..., :K]  # [2, 3, K]: leading dims flatten to rows
    from engine.quant import dequantize_fp8

    for v in _variants(True):
        got = linear.fp8_gemv(x3, fw, variant=v)
        assert got.shape == (2, 3, N)
        _assert_linear_close(got.view(6, N), x3.reshape(6, K), dequantize_fp8(fw))
    for v in _variants(False):
        _assert_linear_close(linear.gemv(x, w, splits=2, variant=v), x, w.float())
    with pytest.raises(ValueError, match="16-byte aligned"):
        linear.gemv(wide[:, 4:4 + K], w)
    # make_linear with a plan that picks the kernel: the kernel's result for aligned rows,
    # the library's (exactly) for rows it cannot take
    plan = linear.LinearPlan.from_rows([
        {"fp8": False, "m": 8, "n": N, "k": K, "impl": "gemv", "splits": 2, "variant": 1,
         "kwarps": 4},
        {"fp8": True, "m": 8, "n": N, "k": K, "impl": "gemv", "splits": 1, "variant": 1}])
    fn = linear.make_linear(plan, kernels=True)
    assert torch.equal(fn(x, w), linear.gemv(x, w, splits=2, kwarps=4, variant=1))
    assert torch.equal(fn(x, fw), linear.fp8_gemv(x, fw, splits=1, variant=1))
    bad = wide[:, 4:4 + K]
    assert torch.equal(fn(bad, w), F.linear(bad, w))
    assert torch.equal(linear.make_linear(None, kernels=True)(x, w), F.linear(x, w))
    tri = linear.triton_fp8()
    ref = fp8_linear_torch if tri is None else tri
    torch.testing.assert_close(linear.make_linear(None, kernels=True)(x, fw), ref(x, fw))


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("fp8,variant", [(False, 0), (False, 1), (True, 0), (True, 1),
                                         (True, 2)])
def test_linear_cuda_graph_replay(fp8, variant):
    """Captured once (split-K workspace from the graph's pool), replayed on new inputs."""
    from engine.quant import dequantize_fp8, quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    w = (_bf16(2560, 4096, seed=3, device="cuda").float() / 64).to(torch.bfloat16)
    fw = quantize_fp8(w)
    run = ((lambda x: linear.fp8_gemv(x, fw, splits=4, variant=variant)) if fp8
           else (lambda x: linear.gemv(x, w, splits=4, variant=variant)))
    x = torch.zeros(4, 4096, dtype=torch.bfloat16, device="cuda")
    run(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(x)
    for seed in (7, 8):
        x.copy_(_bf16(4, 4096, seed=seed, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        _assert_linear_close(out, x, dequantize_fp8(fw) if fp8 else w.float())


def _assert_plain_forms_equal_variant0(variant, M, launches):
    """`variant`'s plain results (bf16 and FP8 weights) and its residual and SwiGLU
    epilogues (bf16) bit-equal to variant 0's for each launch's parameters, on S2-Pro
    shapes, a partial K chunk and a single chunk."""
    from engine.quant import quantize_fp8

    for N, K in ((6144, 2560), (2560, 9728), (300, 2576), (40, 48)):
        w = (_bf16(N, K, seed=N + K, device="cuda").float() / K**0.5).to(torch.bfloat16)
        x = _bf16(M, K, seed=M, device="cuda")
        r = _bf16(M, N, seed=M + 1, device="cuda")
        fw = quantize_fp8(w)
        for kw in launches:
            where = (variant, N, K, kw)
            assert torch.equal(linear.gemv(x, w, variant=variant, **kw),
                               linear.gemv(x, w, variant=0, **kw)), where
            assert torch.equal(linear.fp8_gemv(x, fw, variant=variant, **kw),
                               linear.fp8_gemv(x, fw, variant=0, **kw)), where
            assert torch.equal(linear.gemv_residual(x, w, r, variant=variant, **kw),
                               linear.gemv_residual(x, w, r, variant=0, **kw)), where
            if N % 2 == 0:
                assert torch.equal(linear.gemv_swiglu(x, w, variant=variant, **kw),
                                   linear.gemv_swiglu(x, w, variant=0, **kw)), where


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("pdl", [0, 1])
def test_variant4_is_bit_equal_to_variant0_cuda(M, pdl):
    """Variant 4 runs variant 0's batches software-pipelined (the next batch's loads before
    this batch's MMAs, the first before the PDL wait): the same products summed in the same
    order, so every result is bit-equal to variant 0's — plain, split K, every kwarps, the
    residual and SwiGLU epilogues, the normed prologue, bf16 and FP8 weights, K with a
    partial chunk and K with a single one, launched plainly and with PDL inside a graph."""
    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    launches = ((0, 0), (1, 0), (3, 2), (64, 0), (1, 1), (1, 4), (1, 8))
    _assert_plain_forms_equal_variant0(4, M, [{"splits": s, "kwarps": k, "pdl": pdl}
                                              for s, k in launches])
    K, eps = 2560, 1e-6
    h = _bf16(min(M, 16), K, seed=5, device="cuda") * 3
    nw = (1 + 0.1 * _bf16(K, seed=6, device="cuda").float()).to(torch.bfloat16)
    w13 = (_bf16(2 * 640, K, seed=8, device="cuda").float() / K**0.5).to(torch.bfloat16)
    for ww in (w13, quantize_fp8(w13)):
        for splits, kwarps in launches:
            kw = {"splits": splits, "kwarps": kwarps, "pdl": pdl}
            for glu in (False, True):
                assert torch.equal(
                    linear.gemv_normed(h, nw, eps, ww, glu=glu, variant=4, **kw),
                    linear.gemv_normed(h, nw, eps, ww, glu=glu, variant=0, **kw)), \
                    (splits, kwarps, glu)
            if not isinstance(ww, torch.Tensor):
                xs = _bf16(min(M, 16), K, seed=9, device="cuda")
                assert torch.equal(linear.gemv_swiglu(xs, ww, variant=4, **kw),
                                   linear.gemv_swiglu(xs, ww, variant=0, **kw))
    # captured in a graph and replayed on new inputs (the first batch is read before the wait)
    w = (_bf16(4096, 2560, seed=3, device="cuda").float() / 50).to(torch.bfloat16)
    fw = quantize_fp8(w)
    xin = torch.zeros(M, 2560, dtype=torch.bfloat16, device="cuda")
    outs = [linear.gemv(xin, w, variant=4, pdl=pdl), linear.fp8_gemv(xin, fw, variant=4, pdl=pdl)]
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear.gemv(xin, w, variant=4, pdl=pdl)
        outs = [y, linear.fp8_gemv(y[:, :2560].contiguous(), fw, variant=4, pdl=pdl)]
    for seed in (7, 8):
        xin.copy_(_bf16(M, 2560, seed=seed, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        y0 = linear.gemv(xin, w, variant=0)
        assert torch.equal(outs[0], y0)
        assert torch.equal(outs[1], linear.fp8_gemv(y0[:, :2560].contiguous(), fw, variant=0))


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 64])
def test_variant5_is_bit_equal_to_variant0_with_one_warp_per_tile_cuda(M):
    """Variant 5 is variant 4 with smaller batches: with one warp per tile a warp still sums
    its chunks in K order, so it is bit-equal to variant 0 (plain, split K, residual,
    SwiGLU, the normed prologue, bf16 and FP8, PDL); with several warps per tile the order
    differs (the reference tests bound it like every variant's)."""
    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    _assert_plain_forms_equal_variant0(5, M, [{"splits": s, "kwarps": 1, "pdl": p}
                                              for s, p in ((1, 0), (3, 1), (64, 1))])
    K, eps = 2560, 1e-6
    h = _bf16(min(M, 16), K, seed=5, device="cuda") * 3
    nw = (1 + 0.1 * _bf16(K, seed=6, device="cuda").float()).to(torch.bfloat16)
    w13 = (_bf16(2 * 640, K, seed=8, device="cuda").float() / K**0.5).to(torch.bfloat16)
    for ww in (w13, quantize_fp8(w13)):
        for glu in (False, True):
            kw = {"splits": 1, "kwarps": 1, "pdl": 1}
            assert torch.equal(linear.gemv_normed(h, nw, eps, ww, glu=glu, variant=5, **kw),
                               linear.gemv_normed(h, nw, eps, ww, glu=glu, variant=0, **kw))


def _fp8_forms_case(M, N, K):
    """CUDA operands for every form of an FP8 linear at M rows: W [N, K], x with strided
    rows (x 3), a residual [M, N], a norm weight [K] and a packed [W1; W3] of 2 x 640 rows
    (None where K is no multiple of 128)."""
    from engine.quant import quantize_fp8

    w = quantize_fp8((_bf16(N, K, seed=N + K, device="cuda").float() / K**0.5)
                     .to(torch.bfloat16))
    wide = _bf16(M, K + 64, seed=M, device="cuda") * 3
    x = wide[:, 32:32 + K]  # strided rows
    r = _bf16(M, N, seed=M + 1, device="cuda")
    nw = (1 + 0.1 * _bf16(K, seed=6, device="cuda").float()).to(torch.bfloat16)
    w13 = quantize_fp8((_bf16(2 * 640, K, seed=8, device="cuda").float() / K**0.5)
                       .to(torch.bfloat16)) if K % 128 == 0 else None
    return w, x, r, nw, w13


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16])
def test_variant7_matches_its_w8a8_reference_cuda(M):
    """Variant 7 (x quantised per 1 x 128 block in its prologue, e4m3 MMAs) against its torch
    reference (`fp8_linear_w8a8_torch`: the same rounding of x, float32 products): within
    2^-7 of each output plus 2^-9 of sum |x w| (the MMAs' accumulation, the scales applied
    per block, a rare tie rounding one x element the other way), in every form (plain,
    residual, SwiGLU, the normed prologue; split K, one and two warps per tile, plain and
    PDL launches, strided rows, a partial K block, a partial tile, a graph replay), and
    measurably off the weight-only product (it does quantise x)."""
    from engine.kernels.fp8_triton import fp8_linear_w8a8_torch
    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("variant 7 needs compute capability 8.9+")
    eps = 1e-6

    def close(got, want, x, w, where, loose=False):  # type: ignore[no-untyped-def]
        """loose: the normed rows differ from rms_norm's in a rare ulp, which can move a
        block's scale and so every rounding in it (2^-4 of sum |x w| still fails a wrong
        permutation or scale, whose errors are of its size)."""
        from engine.quant import dequantize_fp8

        mag = x.float().abs() @ dequantize_fp8(w).abs().T
        err = (got.float() - want.float()).abs()
        bound = 2**-7 * want.float().abs() + (2**-4 if loose else 2**-9) * mag
        assert bool((err <= bound).all()), (where, float((err - bound).max()))

    for N, K in ((6144, 2560), (2560, 9728), (300, 2576), (40, 48)):
        if not linear._quantises(M, K, False):
            continue
        w, x, r, nw, w13 = _fp8_forms_case(M, N, K)
        want = fp8_linear_w8a8_torch(x, w)
        xn = functional.rms_norm(x, nw, eps)
        want_n = fp8_linear_w8a8_torch(xn, w)
        assert (want.float() - linear.fp8_linear_torch(x, w).float()).abs().max() > 0
        for splits, kwarps, pdl in ((1, 1, 1), (3, 1, 0), (1, 2, 1), (2, 2, 1), (0, 0, 1)):
            kw = {"splits": splits, "kwarps": kwarps, "pdl": pdl, "variant": 7}
            where = (N, K, splits, kwarps, pdl)
            close(linear.fp8_gemv(x, w, **kw), want, x, w, where)
            got = linear._run(x, w.q, w.scale, splits, kwarps, 7, residual=r, pdl=pdl)
            close(got - r, want, x, w, ("residual", *where))  # the sum rounds once more
            if linear._quantises(M, K, True):
                close(linear.gemv_normed(x, nw, eps, w, **kw), want_n, xn, w, ("normed", *where),
                      loose=True)
            if w13 is not None and M <= linear.FP8_GLU_MAX_M:
                gu = fp8_linear_w8a8_torch(x, w13).float()
                ref = torch.nn.functional.silu(gu[:, :640]) * gu[:, 640:]
                got = linear.gemv_swiglu(x, w13, **kw).float()
                assert bool(((got - ref).abs() <= 2**-6 * ref.abs() + 2**-6 * ref.abs().max()
                             ).all()), ("glu", *where)
    # one launch in a CUDA graph replays to the same bits
    K, N = 2560, 6144
    w = quantize_fp8((_bf16(N, K, seed=7, device="cuda").float() / K**0.5).to(torch.bfloat16))
    x = _bf16(M, K, seed=5, device="cuda")
    eager = linear.fp8_gemv(x, w, variant=7, pdl=1)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        linear.fp8_gemv(x, w, variant=7, pdl=1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = linear.fp8_gemv(x, w, variant=7, pdl=1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.cuda
@_cuda
def test_gemv_w8a8_rows_keep_the_epilogues_in_variant_7s_launch_cuda():
    """With `fp8_activations` and a "gemv_w8a8" row, make_linear runs variant 7 with the
    row's splits and kwarps, and make_swiglu / make_residual / make_normed take the call
    into variant 7's launch (epilogue, normed prologue) instead of declining it: the bits
    of the direct launches. Without the option the weight-only row's kernels run."""
    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("variant 7 needs compute capability 8.9+")
    K, N, M = 2560, 1280, 2
    rows = []
    for n in (N, 2 * N):
        rows += [{"fp8": True, "m": M, "n": n, "k": K, "impl": "gemv", "splits": 1,
                  "kwarps": 4, "variant": 5, "us": {"gemv:v5:k4:s1": 10.0}},
                 {"fp8": True, "m": M, "n": n, "k": K, "impl": "gemv_w8a8", "splits": 2,
                  "kwarps": 2, "variant": 7, "us": {"gemv_w8a8:v7:k2:s2": 7.0}}]
    plan = linear.LinearPlan.from_rows(rows)
    w = quantize_fp8((_bf16(N, K, seed=1, device="cuda").float() / K**0.5).to(torch.bfloat16))
    w13 = quantize_fp8((_bf16(2 * N, K, seed=2, device="cuda").float() / K**0.5)
                       .to(torch.bfloat16))
    x = _bf16(M, K, seed=3, device="cuda")
    r = _bf16(M, N, seed=4, device="cuda")
    nw = (1 + 0.1 * _bf16(K, seed=5, device="cuda").float()).to(torch.bfloat16)
    v7 = {"splits": 2, "kwarps": 2, "variant": 7, "pdl": 1}
    lin = linear.make_linear(plan, True, fp8_activations=True, pdl=1)
    assert torch.equal(lin(x, w), linear.fp8_gemv(x, w, **v7))
    swiglu = linear.make_swiglu(plan, True, pdl=1, fp8_activations=True)
    assert torch.equal(swiglu(x, w13), linear.gemv_swiglu(x, w13, **v7))
    residual = linear.make_residual(plan, True, pdl=1, fp8_activations=True)
    assert torch.equal(residual(x, w, r),
                       linear._run(x, w.q, w.scale, 2, 2, 7, residual=r, pdl=1))
    normed = linear.make_normed(plan, True, pdl=1, fp8_activations=True)
    assert torch.equal(normed(x, nw, 1e-6, w13, True),
                       linear.gemv_normed(x, nw, 1e-6, w13, glu=True, **v7))
    plain = linear.make_linear(plan, True, pdl=1)  # the weight-only row
    assert torch.equal(plain(x, w), linear.fp8_gemv(x, w, splits=1, kwarps=4, variant=5, pdl=1))


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16])
def test_variant6_is_bit_equal_to_variant5_cuda(M):
    """Variant 6 multiplies each x row staged as 2^e-scaled f16 by the hardware-converted
    e4m3 values: every product is 2^e times variant 5's, so where the f16 MMAs sum as the
    bf16 ones do every result is bit-equal (plain, residual, SwiGLU, the normed prologue;
    split K, one and two warps per tile, plain and PDL launches, strided rows, a partial K
    chunk, a graph replay; an infinity in a row; rows that expose the MMAs' alignment of
    products, `cancellation_case`; staged f16 subnormals, `small_binade_case`). Values
    under 2^-31 of their row's largest are rounded when staged: an absolute error of at
    most 2^-25 staged units (2^-39 of the row's largest) per value, times its weights."""
    from engine.quant import Fp8Weight, quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    if 6 not in _variants(True, M, 2560):
        pytest.skip("variant 6 needs compute capability 8.9+")
    eps = 1e-6
    for N, K in ((6144, 2560), (2560, 9728), (300, 2576), (40, 48)):
        if not linear._stages(M, K):
            continue
        w, x, r, nw, w13 = _fp8_forms_case(M, N, K)
        for splits, kwarps, pdl in ((1, 1, 1), (3, 1, 0), (1, 2, 1), (2, 2, 1), (0, 0, 1)):
            kw = {"splits": splits, "kwarps": kwarps, "pdl": pdl}
            where = (N, K, splits, kwarps, pdl)

            def both(fn, *args, kw=kw, **more):
                return fn(*args, variant=6, **kw, **more), fn(*args, variant=5, **kw, **more)

            def residual(x, w, r, *, variant, splits, kwarps, pdl):  # type: ignore[no-untyped-def]
                # FP8's residual epilogue as make_residual launches it (gemv_residual: bf16 W)
                return linear._run(x, w.q, w.scale, splits, kwarps, variant, residual=r, pdl=pdl)

            for got, want in (both(linear.fp8_gemv, x, w),
                              both(residual, x, w, r),
                              both(linear.gemv_normed, x, nw, eps, w)):
                assert torch.equal(got, want), where
            if w13 is not None and M <= linear.FP8_GLU_MAX_M:
                for got, want in (both(linear.gemv_swiglu, x, w13),
                                  both(linear.gemv_normed, x, nw, eps, w13, glu=True)):
                    assert torch.equal(got, want), ("glu", *where)
    K = 2560
    w = quantize_fp8((_bf16(6144, K, seed=7, device="cuda").float() / K**0.5).to(torch.bfloat16))
    h = _bf16(M, K, seed=5, device="cuda") * 3

    def v6_v5(x):
        return (linear.fp8_gemv(x, w, variant=6, kwarps=1),
                linear.fp8_gemv(x, w, variant=5, kwarps=1))

    # how the MMAs align products (+P, -P and small ones in one k-group), and staged f16
    # subnormals (x in [2^-17, 2^-14) of a row led by 2^14 whose weight is 0): bit-equal
    for case in (linear.cancellation_case, linear.small_binade_case):
        cw, cx = case(M, 256, 256, seed=M)
        for kw in ({"kwarps": 1}, {"kwarps": 2, "splits": 2}):
            assert torch.equal(linear.fp8_gemv(cx, cw, variant=6, **kw),
                               linear.fp8_gemv(cx, cw, variant=5, **kw)), (case.__name__, kw)
    # an infinity in a row: the row's scale comes from its finite values, as variant 5 sums
    inf = h.clone()
    inf[0, 3] = float("inf")
    torch.testing.assert_close(*v6_v5(inf), rtol=0, atol=0, equal_nan=True)
    # below 2^-31 of the row's largest a value is rounded to the staged f16 subnormal grid
    # (2^-24 staged units; 3 * 2^-26 in a row led by 2^14 stages as 2^-24): within half a
    # step per value times its weight, which a flush to zero of [2^-26, 2^-23) would exceed
    tw, tx = linear.small_binade_case(M, 256, 256, seed=9)
    # no cancellation (positive x and w), so that zeroed values would show
    tw = Fp8Weight(tw.q.float().abs().to(torch.float8_e4m3fn), tw.scale)
    tx[:, 1:] = (tx[:, 1:].float().abs() * 2.0**-9).to(torch.bfloat16)  # [2^-26, 2^-23)
    got, want = (linear.fp8_gemv(tx, tw, variant=v, kwarps=1).float() for v in (6, 5))
    wabs = (tw.q.float() * tw.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            [: tw.q.shape[0], : tw.q.shape[1]]).abs()  # [N, K]
    bound = 1.0625 * 2.0**-25 * wabs.sum(1)[None, :] + 2**-7 * want.abs()  # + the rounding
    assert bool(((got - want).abs() <= bound).all())
    # a graph replay on new rows
    hin = torch.zeros_like(h)
    linear.fp8_gemv(hin, w, variant=6, kwarps=1, pdl=1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = linear.fp8_gemv(hin, w, variant=6, kwarps=1, pdl=1)
    for seed in (11, 12):
        hin.copy_(_bf16(M, K, seed=seed, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear.fp8_gemv(hin, w, variant=5, kwarps=1))


# [W1; W3] shapes: S2-Pro's slow AR FFN (I = 9728), I = 300 (a partial 8-row output group:
# 300 % 8 = 4, and the gate rows past I must not be read as up rows), I = 17 with K = 2576
# (a partial K chunk), I = 20 with K = 48 (one partial chunk only)
_GLU_SHAPES = [(2 * 9728, 2560), (600, 2560), (34, 2576), (40, 48)]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 values' distance in units in the last place (same-sign neighbours)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return torch.where((ia < 0) == (ib < 0), (ia - ib).abs(), (ia & 0x7FFF) + (ib & 0x7FFF))


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("N,K", _GLU_SHAPES)
@pytest.mark.parametrize("M", _LINEAR_MS)
def test_gemv_swiglu_cuda_matches_unfused(N, K, M):
    """The SwiGLU epilogue against the unfused ops on the kernel's own linear: with the same
    splits, kwarps and variant the gate and up accumulators are gemv's, so the result is
    F.silu(gate) * up of gemv's output (bit for bit up to the last ulp of torch's exp); and
    against the float32 math within the bf16 roundings the unfused path makes."""
    import torch.nn.functional as F

    assert extension_available(), "the CUDA extension did not build"
    w13 = (_bf16(N, K, seed=N + K, device="cuda").float() / K**0.5).to(torch.bfloat16)
    x = _bf16(M, K, seed=M, device="cuda")
    i = N // 2
    ref32 = F.silu(x.float() @ w13[:i].float().t()) * (x.float() @ w13[i:].float().t())
    for v in _variants(False):
        for splits, kwarps in ((0, 0), (1, 0), (3, 0), (64, 0), (1, 1), (1, 2), (1, 4),
                               (1, 8), (3, 2)):
            got = linear.gemv_swiglu(x, w13, splits=splits, kwarps=kwarps, variant=v)
            h = linear.gemv(x, w13, splits=splits, kwarps=kwarps, variant=v)
            want = F.silu(h[:, :i]) * h[:, i:]
            where = f"variant {v}, splits {splits}, kwarps {kwarps}"
            assert got.shape == (M, i) and got.dtype == torch.bfloat16, where
            ulps = _ulps_apart(got, want)
            assert int(ulps.max()) <= 1, f"{where}: {int(ulps.max())} ulps off"
            assert float((ulps > 0).float().mean()) < 1e-3, where
            # the float32 math: two bf16 roundings of the linears (each within the kernel's
            # bound), silu's and the product's (|silu'| <= 1.1)
            err = (got.float() - ref32).abs()
            s1 = x.float().abs() @ w13[:i].float().abs().t()  # sum |x w1|: the gate's bound
            s3 = x.float().abs() @ w13[i:].float().abs().t()
            up = (x.float() @ w13[i:].float().t()).abs()
            act = F.silu(x.float() @ w13[:i].float().t()).abs()
            bound = 2**-6 * ref32.abs() + 2**-12 * (s1 * (up + 1) + s3 * (act + 1))
            assert bool((err <= bound + 1e-6).all()), \
                f"{where}: max error {float(err.max()):.3g}"


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16])
def test_gemv_swiglu_fp8_cuda_matches_unfused(M):
    """The SwiGLU epilogue on FP8 [W1; W3] (variant 0, I a multiple of 128): the gate rows
    and the up rows of a tile scaled by their own block-scale rows, so the result is
    F.silu(gate) * up of fp8_gemv's output (up to the last ulp of torch's exp), splits and
    kwarps included; I = 384 has three block rows each."""
    import torch.nn.functional as F

    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    for N, K in ((2 * 9728, 2560), (768, 256)):
        w = (_bf16(N, K, seed=N, device="cuda").float() / K**0.5).to(torch.bfloat16)
        # per-block magnitudes that differ between W1's and W3's block rows
        w = (w.float() * torch.linspace(0.5, 4.0, N, device="cuda")[:, None]).to(torch.bfloat16)
        f13 = quantize_fp8(w)
        x = _bf16(M, K, seed=M, device="cuda")
        i = N // 2
        for splits, kwarps in ((0, 0), (1, 0), (3, 2), (1, 8)):
            got = linear.gemv_swiglu(x, f13, splits=splits, kwarps=kwarps)
            h = linear.fp8_gemv(x, f13, splits=splits, kwarps=kwarps)
            ulps = _ulps_apart(got, F.silu(h[:, :i]) * h[:, i:])
            where = f"N {N}, splits {splits}, kwarps {kwarps}"
            assert int(ulps.max()) <= 1, f"{where}: {int(ulps.max())} ulps off"
            assert float((ulps > 0).float().mean()) < 1e-3, where

def test_normed_params_take_fewer_warps_per_tile_within_the_slack():
    """The normed prologue runs in every block: it takes the fewest warps per tile among the
    row's register-batch candidates (variants 0 and 4) within NORMED_SLACK_US of the fastest
    (the row's own among them), also where the row chose another implementation by less than
    that; None where no such candidate is that close. The attention prologue's lookup takes
    variant 0 only."""
    def row(us, kwarps=8, splits=1, variant=0):
        return linear.PlanRow(False, 1, 19456, 2560, "gemv", splits, tuple(us.items()), kwarps,
                              variant)

    r = row({"gemv:v0:k8:s1": 27.8, "gemv:v0:k4:s1": 28.1, "gemv:v0:k1:s2": 28.4,
             "gemv:v1:k2:s1": 27.9, "library": 30.0})
    assert linear._normed_params(r) == (2, 1, 0)  # k1 (split 2) within 1 us; v1 has none
    r = row({"gemv:v0:k8:s1": 27.8, "gemv:v0:k4:s1": 28.9, "gemv:v0:k1:s1": 30.0})
    assert linear._normed_params(r) == (1, 8, 0)  # nothing close enough: the row's own
    r = row({"gemv:v0:k2:s4": 9.0, "gemv:v0:k8:s1": 9.5}, kwarps=2, splits=4)
    assert linear._normed_params(r) == (4, 2, 0)  # already the fewest
    # another implementation chosen by less than the slack: the prologue still runs
    lib = linear.PlanRow(False, 1, 6144, 2560, "library", 1,
                         (("library", 11.18), ("gemv:v0:k8:s1", 11.2), ("gemv:v0:k4:s1", 11.83),
                          ("gemv:v1:k8:s1", 11.3)))
    assert linear._normed_params(lib) == (1, 4, 0)
    v1 = row({"gemv:v1:k8:s1": 10.0, "gemv:v0:k8:s1": 10.6, "gemv:v0:k2:s1": 11.5},
             variant=1)
    assert linear._normed_params(v1) == (1, 8, 0)
    far = linear.PlanRow(False, 1, 6144, 2560, "library", 1,
                         (("library", 9.0), ("gemv:v0:k8:s1", 10.5), ("gemv:v1:k8:s1", 9.2)))
    assert linear._normed_params(far) is None  # no variant-0 candidate close enough
    # variant 4 (the pipelined register batches) has the prologue too: the row's own choice
    # here, and among the near candidates the fewest warps per tile whatever the variant
    v4 = row({"gemv:v4:k8:s1": 7.0, "gemv:v0:k8:s1": 8.1, "gemv:v4:k2:s1": 7.5}, variant=4)
    assert linear._normed_params(v4) == (1, 2, 4)
    assert linear._normed_params(v4, (0,)) is None  # 8.1 is not within 1 us of 7.0
    mix = row({"gemv:v4:k4:s1": 7.0, "gemv:v0:k2:s1": 7.6}, kwarps=4, variant=4)
    assert linear._normed_params(mix) == (1, 2, 0)
    assert linear._normed_params(mix, (4,)) == (1, 4, 4)


def test_glu_row_prefers_a_candidate_with_the_epilogue(monkeypatch):
    """The packed [W1; W3] linear runs the SwiGLU epilogue with the plan's row where its kernel
    has one, else with the fastest recorded csrc candidate that has it (FP8: variant 0) when
    that costs less than the silu * mul launch it saves; never a slower one, never on the CPU."""
    monkeypatch.setattr(linear, "supports", lambda m, n, k, fp8, variant=0: variant in (0, 1, 2))

    def row(fp8, impl, us, variant=0, config=None):
        return linear.PlanRow(fp8, 1, 256, 128, impl, 1, tuple(us.items()), 4, variant, config)

    def glu(r, cuda=True):
        return linear._glu_row(linear.LinearPlan((r,)), True, 1, 256, 128, r.fp8,
                               torch.bfloat16, cuda)

    # FP8, the fastest is variant 2 (no epilogue): variant 0's best within 1.5 us is taken
    r = row(True, "gemv", {"gemv:v2:k2:s1": 10.0, "gemv:v0:k4:s1": 11.2, "gemv:v0:k2:s2": 11.0,
                           "triton:16x64x128w4s4:k3": 10.5}, variant=2)
    g = glu(r)
    assert (g.impl, g.variant, g.kwarps, g.splits) == ("gemv", 0, 2, 2)
    assert glu(r, cuda=False) is None
    # ... but not when the epilogue's candidate is slower by more than the launch it saves
    r = row(True, "gemv", {"gemv:v2:k2:s1": 10.0, "gemv:v0:k4:s1": 11.6}, variant=2)
    assert glu(r) is None
    # a Triton choice: a close csrc candidate takes the FFN with its epilogue
    cfg = (("block_k", 128), ("block_m", 16), ("block_n", 64))
    r = row(True, "triton", {"triton:16x64x128w4s4:k3": 10.0, "gemv:v0:k8:s1": 10.9}, config=cfg)
    g = glu(r)
    assert (g.impl, g.variant, g.kwarps, g.config) == ("gemv", 0, 8, None)
    # bf16: the chosen variant 1 has the epilogue and is kept as it is
    r = row(False, "gemv", {"gemv:v1:k8:s1": 9.0, "gemv:v0:k8:s1": 9.1}, variant=1)
    assert glu(r) == r
    # the library's shapes with no csrc candidate: none
    assert glu(row(False, "library", {"library": 9.0})) is None


@pytest.mark.cuda
@_cuda
def test_swiglu_kernel_in_ops_and_graph_replay():
    """make_swiglu with a plan that picks the kernel (split K through the glu reduce): the
    kernel's result, captured in a CUDA graph and replayed on new inputs; Ops.swiglu runs it
    for packed weights; a shape the plan leaves to the library returns None."""
    from engine.ops import Ops

    assert extension_available(), "the CUDA extension did not build"
    N, K = 2 * 1024, 2560
    w13 = (_bf16(N, K, seed=4, device="cuda").float() / K**0.5).to(torch.bfloat16)
    plan = linear.LinearPlan.from_rows([
        {"fp8": False, "m": 4, "n": N, "k": K, "impl": "gemv", "splits": 3, "kwarps": 2,
         "variant": 1},
        {"fp8": False, "m": 64, "n": N, "k": K, "impl": "library"}])
    fn = linear.make_swiglu(plan, kernels=True)
    x = torch.zeros(4, K, dtype=torch.bfloat16, device="cuda")
    assert fn(_bf16(32, K, device="cuda"), w13) is None
    ops = Ops(packed_ffn=True, swiglu_kernel=fn)
    w1, w3 = w13[: N // 2], w13[N // 2:]
    ops.swiglu(x, w1, w3)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.swiglu(x, w1, w3)
    for seed in (7, 8):
        x.copy_(_bf16(4, K, seed=seed, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear.gemv_swiglu(x, w13, splits=3, kwarps=2, variant=1))


def _cl(B: int, C: int, T: int, *, dtype, device, pad: int = 0, seed: int = 0) -> torch.Tensor:
    """A channels-last [B, C, T] (stored [B, T + pad, C]; pad > 0: a slice, streams apart)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    full = torch.randn(B, T + pad, C, generator=g).to(device, dtype)
    return full[:, pad:].transpose(1, 2)


def test_channels_last_fallbacks_keep_the_layout():
    x = _cl(2, 16, 9, dtype=torch.float32, device="cpu", pad=3)
    y = _cl(2, 16, 9, dtype=torch.float32, device="cpu", seed=1)
    tail = torch.randn(2, 16, 4)
    alpha, b = torch.rand(16) + 0.3, torch.randn(16)
    for out in (activation.snake(x, alpha, b), activation.bias_residual(x, y, b),
                activation.snake_cat(tail, x, alpha, b)):
        assert activation.is_channels_last(out) and out.stride(0) == out.shape[1] * out.shape[2]
    assert torch.equal(activation.snake_cat(tail, x, alpha, b),
                       torch.cat([tail, activation.snake_torch(x, alpha, b)], -1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [96, 5])  # 16-byte vectors, and the scalar path
def test_channels_last_kernels_match_the_torch_formulas(dtype, C):
    """csrc's Snake, bias_residual and snake_cat on channels-last operands (the codec's NHWC
    layout; inputs may be slices along T) in a dense channels-last result: float32 equal to
    the torch formulas; bf16 within 2 ulps of the float32 formula rounded once, as the kernel
    computes it (torch's bf16 formula rounds after every op and strays further)."""
    assert activation.kernel_ok(True, torch.zeros(1, device="cuda")), "extension not built"
    from engine.codec.layers import snake as formula

    dev = "cuda"
    x = _cl(3, C, 37, dtype=dtype, device=dev, pad=5)
    y = _cl(3, C, 37, dtype=dtype, device=dev, seed=1)
    tail = torch.randn(3, C, 6, device=dev).to(dtype)  # channels-first, as the saved tails
    alpha = (torch.rand(C, device=dev) + 0.3).to(dtype)
    b = torch.randn(C, device=dev).to(dtype)
    a32, b32 = alpha.float()[None, :, None], b.float()[None, :, None]

    def once(t: torch.Tensor) -> torch.Tensor:  # the kernel's roundings: its output, x + bias
        return t.to(dtype).float()

    s = once(x.float() + b32)
    cases = [(activation.snake(x, alpha), formula(x.float(), a32)),
             (activation.snake(x, alpha, b), formula(s, a32)),
             (activation.bias_residual(x, y, b), x.float() + once(y.float() + b32)),
             (activation.snake_cat(tail, x, alpha, b), torch.cat([tail.float(), formula(s, a32)], -1))]
    for got, want in cases:
        assert activation.is_channels_last(got) and got.stride(0) == got.shape[1] * got.shape[2]
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), once(want), rtol=2**-6, atol=1e-3)


# ------------------------------------------------- residual epilogue and normed prologue
def test_residual_and_normed_fallbacks_contract_and_dispatch():
    """Off the kernel gemv_residual / gemv_normed are the unfused references and check their
    contracts; make_residual / make_normed answer None wherever the kernel does not take the
    call (on CUDA: test_residual_epilogue_and_normed_prologue_cuda)."""
    import torch.nn.functional as F

    from engine import functional
    from engine.quant import fp8_linear_torch, quantize_fp8

    x, w, r = _bf16(3, 64), _bf16(40, 64, seed=1), _bf16(3, 40, seed=2)
    assert torch.equal(linear.gemv_residual(x, w, r), r + F.linear(x, w))
    assert torch.equal(linear.residual_reference(x, w, r), r + F.linear(x, w))
    for bad, match in ((_bf16(3, 41), "output's shape"), (r.float(), "bfloat16"),
                       (_bf16(40, 3).t(), "last dim must be contiguous")):
        with pytest.raises(ValueError, match=match):
            linear.gemv_residual(x, w, bad)
    nw = _bf16(64, seed=3)
    xn = functional.rms_norm(x, nw, 1e-6)
    assert torch.equal(linear.gemv_normed(x, nw, 1e-6, w), F.linear(xn, w))
    w13 = _bf16(80, 64, seed=4)
    assert torch.equal(linear.gemv_normed(x, nw, 1e-6, w13, glu=True),
                       linear.swiglu_reference(xn, w13))
    # FP8 weights: the norm, then the dequantising linear (its SwiGLU for [W1; W3])
    f8, f13 = quantize_fp8(_bf16(128, 64, seed=6)), quantize_fp8(_bf16(256, 64, seed=7))
    assert torch.equal(linear.gemv_normed(x, nw, 1e-6, f8), fp8_linear_torch(xn, f8))
    assert torch.equal(linear.gemv_normed(x, nw, 1e-6, f13, glu=True),
                       linear.swiglu_reference(xn, f13))
    for args, match in (((x, nw, 1e-6, f8.q), "bfloat16 tensor"),
                        ((_bf16(17, 64), nw, 1e-6, w), "at most 16 rows"),
                        ((x, nw[:32], 1e-6, w), r"bfloat16 \[K\]"),
                        ((x, nw, -1.0, w), "eps must be")):
        with pytest.raises(ValueError, match=match):
            linear.gemv_normed(*args)
    plan = linear.LinearPlan.from_rows(_plan_rows())  # n = 256, k = 64: gemv at m <= 8
    w256 = _bf16(256, 64, seed=5)
    assert linear.make_residual(plan, kernels=True)(x, w256, _bf16(3, 256)) is None  # CPU
    assert linear.make_normed(plan, kernels=True)(x, nw, 1e-6, w256, False) is None
    assert linear.make_normed(None, kernels=True)(x, nw, 1e-6, w256, False) is None


def test_residual_row_takes_a_csrc_candidate_within_the_slack(monkeypatch):
    """make_residual's row (`_gemv_row` with RESIDUAL_SLACK_US): the plan's csrc row; where the
    plan chose another implementation, its fastest csrc candidate within the slack as a
    "gemv" row (the add's launch saved); nothing when none is that close or off CUDA."""
    monkeypatch.setattr(linear, "supports", lambda m, n, k, fp8, variant=0: variant in (0, 1))
    rows = [{"fp8": False, "m": 1, "n": 2560, "k": 4096, "impl": "library", "splits": 1,
             "us": {"library": 8.6, "gemv:v0:k8:s1": 8.67, "gemv:v1:k4:s2": 9.0}},
            {"fp8": False, "m": 2, "n": 2560, "k": 4096, "impl": "library", "splits": 1,
             "us": {"library": 8.0, "gemv:v0:k8:s1": 9.5}},
            {"fp8": False, "m": 4, "n": 2560, "k": 4096, "impl": "gemv", "splits": 1,
             "kwarps": 4, "variant": 1, "us": {"gemv:v1:k4:s1": 8.0, "library": 8.1}}]
    plan = linear.LinearPlan.from_rows(rows)
    args = (2560, 4096, False, torch.bfloat16, True)
    near = linear._gemv_row(plan, True, 1, *args, slack_us=linear.RESIDUAL_SLACK_US)
    assert (near.impl, near.variant, near.kwarps, near.splits) == ("gemv", 0, 8, 1)
    assert linear._gemv_row(plan, True, 1, *args) is None  # no slack: the plan's library
    assert linear._gemv_row(plan, True, 2, *args, slack_us=linear.RESIDUAL_SLACK_US) is None
    own = linear._gemv_row(plan, True, 4, *args, slack_us=linear.RESIDUAL_SLACK_US)
    assert (own.variant, own.kwarps) == (1, 4)
    assert linear._gemv_row(plan, True, 1, 2560, 4096, False, torch.bfloat16, False,
                            slack_us=5.0) is None  # not CUDA


def _counted(fn, calls, name):
    def run(*args):
        out = fn(*args)
        calls[name] = calls.get(name, 0) + (out is not None)
        return out
    return run


class _CausalAttend:
    """Causal attention over one call's positions only (the model's plumbing tests)."""

    def __call__(self, layer, q, k, v):  # type: ignore[no-untyped-def]
        from engine.model import gqa_attention

        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        return gqa_attention(q, k, v, mask)


def _causal_case(cfg):  # type: ignore[no-untyped-def]
    """(the attention class, frame columns [2, C+1, 5], positions [2, 5]) for a slow pass."""
    cols = torch.zeros(2, cfg.num_codebooks + 1, 5, dtype=torch.long)
    cols[:, 0] = torch.arange(10, 15)
    return _CausalAttend, cols, torch.arange(5)[None].expand(2, -1)


@pytest.mark.parametrize("normed_takes", [True, False])
def test_norm_fusion_plumbing_changes_no_value(tiny_bundle, normed_takes):
    """The model with Ops whose residual / normed kernels are the references: every block's
    add goes through the residual kernel, every norm but the stacks' final ones stays
    pending into the next projection (or, when the normed kernel declines, is computed
    then) — and the slow and fast hidden states are bit-equal to the plain ops'."""
    import copy

    from engine.fusion import pack_ffn
    from engine.ops import REFERENCE, Ops

    calls: dict[str, int] = {}
    normed = ((lambda h, nw, eps, w, glu: linear.normed_reference(h, nw, eps, w, glu))
              if normed_takes else (lambda *a: None))
    ops = Ops(packed_ffn=True, residual_kernel=_counted(linear.residual_reference, calls,
                                                         "residual"),
              normed_kernel=_counted(normed, calls, "normed"))
    m = copy.deepcopy(tiny_bundle.model)
    pack_ffn(m)  # [W1; W3] in one buffer (same values): the normed SwiGLU's weight
    cfg = m.cfg

    Attend, cols, pos = _causal_case(cfg)
    with torch.inference_mode():
        want = m.forward_slow(cols, pos, Attend(), REFERENCE)
        got = m.forward_slow(cols, pos, Attend(), ops)
        assert torch.equal(got, want)
        n = cfg.slow.n_layer
        assert calls["residual"] == 2 * n
        assert calls.get("normed", 0) == (2 * n if normed_takes else 0)
        x = torch.randn(2, 1, cfg.fast.dim)
        assert torch.equal(ops.dense(m.fast_hidden(x, 0, Attend(), ops)),
                           m.fast_hidden(x, 0, Attend(), REFERENCE))
        # the fast head reads the fast AR's final norm pending (its prologue, where taken)
        calls.clear()
        got = m.forward_fast(x, 1, Attend(), ops)
        assert torch.equal(got, m.forward_fast(x, 1, Attend(), REFERENCE))
        n_fast = cfg.fast.n_layer
        assert calls.get("normed", 0) == (2 * n_fast + 1 if normed_takes else 0)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the dispatchers' per-shape choices for a CUDA
    call, made on a machine without one (the kernels they pick are fakes here)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_triton_rows_take_the_residual_and_prequantised_x(monkeypatch):
    """make_residual runs a Triton row's GEMM with the residual in its epilogue (bf16
    "triton": the dense GEMM; with `fp8_activations` a "triton_w8a8" row: the W8A8 GEMM),
    with the row's config and split, where the call meets its contract, else None (the
    linear, then the add); make_prequant names the prequantised GEMM only for an FP8 weight
    whose W8A8 row is a prequant config (its dense copy not faster), on CUDA bf16 x."""
    from engine.kernels import fp8_triton
    from engine.quant import quantize_fp8

    n, k = 256, 128
    pre = {**_CFG, "swap_ab": False, "block_m": 64, "prequant": True}
    rows = [{"fp8": False, "m": 32, "n": n, "k": k, "impl": "triton", "splits": 2,
             "config": {**_CFG, "block_m": 32}, "us": {"library": 9.0, "triton:x": 7.0}},
            {"fp8": True, "m": 32, "n": n, "k": k, "impl": "library",
             "us": {"library": 10.0}},
            {"fp8": True, "m": 32, "n": n, "k": k, "impl": "triton_w8a8", "splits": 1,
             "config": pre, "us": {"triton_w8a8:x": 8.0}},
            {"fp8": True, "m": 64, "n": n, "k": k, "impl": "library", "us": {"library": 9.0}},
            {"fp8": True, "m": 64, "n": n, "k": k, "impl": "triton_w8a8", "splits": 1,
             "config": {**pre, "prequant": False}, "us": {"triton_w8a8:x": 8.0}}]
    plan = linear.LinearPlan.from_rows(rows)
    calls = []

    def fake(name):  # type: ignore[no-untyped-def]
        def run(x, w, *, config, split_k, residual=None):  # type: ignore[no-untyped-def]
            calls.append((name, config, split_k, residual is not None))
            return torch.zeros(*x.shape[:-1], w.shape[0], dtype=x.dtype)
        return run

    for name in ("dense_linear_triton", "fp8_linear_triton_w8a8"):
        monkeypatch.setattr(fp8_triton, name, fake(name))
    monkeypatch.setattr(linear, "_triton_module", lambda: fp8_triton)
    bf = torch.bfloat16
    y, r = torch.randn(20, k).to(bf).as_subclass(_OnCuda), torch.zeros(20, n, dtype=bf)
    wd, wq = torch.randn(n, k).to(bf), quantize_fp8(torch.randn(n, k))
    res = linear.make_residual(plan, kernels=False, fp8_activations=True)
    assert res(y, wd, r) is not None
    assert calls[-1] == ("dense_linear_triton", fp8_triton.Config.from_json(
        {**_CFG, "block_m": 32}), 2, True)
    assert res(y, wq, r) is not None
    assert calls[-1] == ("fp8_linear_triton_w8a8", fp8_triton.Config.from_json(pre, w8a8=True),
                         1, True)
    assert linear.make_residual(plan, kernels=False)(y, wq, r) is None  # weight-only: library
    assert res(y.as_subclass(torch.Tensor), wd, r) is None  # not CUDA
    assert res(y, wd, r.float()) is None and len(calls) == 2  # the residual's contract
    # the prequantised GEMM: the W8A8 row's prequant config, FP8 weights, CUDA bf16 x
    pq = linear.make_prequant(plan, True)
    fn = pq(y, wq)
    assert fn.func is fp8_triton.fp8_linear_triton_prequant
    assert fn.keywords == {"config": fp8_triton.Config.from_json(pre, w8a8=True), "split_k": 1}
    assert pq(y, wd) is None  # a dense weight
    assert pq(torch.randn(40, k).to(bf).as_subclass(_OnCuda), wq) is None  # not prequant
    assert pq(y.as_subclass(torch.Tensor), wq) is None  # CPU
    assert linear.make_prequant(plan, False)(y, wq) is None  # no fp8_activations
    assert linear.make_prequant(None, True)(y, wq) is None
    # the GLU GEMM for a packed w13 where its prequant row is unsplit with 128-wide tiles
    from engine.kernels import act_quant

    glu = linear.make_glu(plan, True)(y, wq)
    assert glu.func is act_quant.glu_w8a8_quant
    assert glu.keywords == {"config": fp8_triton.Config.from_json(pre, w8a8=True)}
    assert linear.make_glu(plan, True)(torch.randn(40, k).to(bf).as_subclass(_OnCuda),
                                        wq) is None  # not prequant at 64 rows
    assert linear.make_glu(plan, True)(y, wd) is None  # a dense weight
    split = linear.LinearPlan.from_rows([{**rows[2], "splits": 2}])
    assert linear.make_glu(split, True)(y, wq) is None  # its timing was split
    narrow = linear.LinearPlan.from_rows([{**rows[2], "config": {**pre, "block_n": 64}}])
    assert linear.make_prequant(narrow, True)(y, wq) is not None
    assert linear.make_glu(narrow, True)(y, wq) is None  # 64-wide tiles: not a whole block
    big = linear.LinearPlan.from_rows([{**rows[2], "m": 128}])
    assert linear.make_prequant(big, True)(torch.randn(100, k).to(bf).as_subclass(_OnCuda),
                                           wq) is not None
    assert linear.make_glu(big, True)(torch.randn(100, k).to(bf).as_subclass(_OnCuda),
                                      wq) is None  # past decode's rows: not timed there
    monkeypatch.setattr(linear, "_triton_module", lambda: None)
    assert linear.make_prequant(plan, True)(y, wq) is None  # no Triton


@pytest.mark.parametrize("glu", [False, True])
def test_prequant_plumbing_changes_no_value(tiny_bundle, glu):
    """With `Ops.prequant` taking every FP8 linear (stand-ins: the torch fallbacks of the
    prequantised GEMM and of the quantising norm and gate), each block's norms before wqkv /
    w13 and its gate before w2 quantise in their own launch (`glu`: the gate formed and
    quantised by w13's GEMM instead, `Ops.glu_quant`), w2's residual add goes into its
    GEMM, and the model's slow and fast hidden states are bit-equal to the plain ops' with
    every FP8 linear the W8A8 reference (the same quantised values either way)."""
    import copy
    import functools

    import torch.nn.functional as F

    from engine.fusion import pack_ffn
    from engine.kernels import act_quant
    from engine.kernels import fp8_triton as ft
    from engine.ops import Ops, PendingGate, PendingGlu
    from engine.quant import Fp8Weight, quantize_model

    m = copy.deepcopy(tiny_bundle.model).to(torch.bfloat16)
    quantize_model(m)
    pack_ffn(m)
    cfg = m.cfg

    def w8a8(x, w):  # type: ignore[no-untyped-def]
        return ft.fp8_linear_w8a8_torch(x, w) if isinstance(w, Fp8Weight) else F.linear(x, w)

    def residual(y, w, r):  # type: ignore[no-untyped-def]
        return r + w8a8(y, w) if isinstance(w, Fp8Weight) else None

    calls: dict[str, int] = {}

    def prequant(x, w):  # type: ignore[no-untyped-def]
        if not isinstance(w, Fp8Weight):
            return None

        def gemm(xa, w, residual=None):  # type: ignore[no-untyped-def]
            calls["gemm"] = calls.get("gemm", 0) + 1
            return ft.fp8_linear_triton_prequant(xa, w, kernel=False, residual=residual)

        return gemm

    def glu_quant(x, w13):  # type: ignore[no-untyped-def]
        if not (glu and isinstance(w13, Fp8Weight) and w13.shape[0] % 256 == 0):
            return None
        return _counted(functools.partial(act_quant.glu_w8a8_quant, kernel=False), calls,
                        "glu")

    plain = Ops(packed_ffn=True, linear=w8a8)
    ops = Ops(packed_ffn=True, linear=w8a8, residual_kernel=residual, prequant=prequant,
              glu_quant=glu_quant,
              norm_quant=_counted(act_quant.rms_norm_quant, calls, "norm_quant"),
              silu_mul_quant=_counted(act_quant.silu_mul_quant, calls, "gate_quant"))
    gated = {"glu": 1, "gemm": 2} if glu else {"gate_quant": 1, "gemm": 3}  # per layer
    if glu:
        assert cfg.slow.intermediate_size % 128 == 0 and cfg.fast.intermediate_size % 128 == 0

    Attend, cols, pos = _causal_case(cfg)
    with torch.inference_mode():
        want = m.forward_slow(cols, pos, Attend(), plain)
        got = m.forward_slow(cols, pos, Attend(), ops)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        n = cfg.slow.n_layer
        # wqkv and w13 read quantising norms, w2 the quantising gate (+ its residual)
        assert calls == {"norm_quant": 2 * n, **{c: k * n for c, k in gated.items()}}, calls
        calls.clear()
        x = torch.randn(2, 1, cfg.fast.dim).to(torch.bfloat16)
        assert torch.equal(m.forward_fast(x, 1, Attend(), ops),
                           m.forward_fast(x, 1, Attend(), plain))
        n_fast = cfg.fast.n_layer
        assert calls == {"norm_quant": 2 * n_fast, **{c: k * n_fast for c, k in gated.items()}}
        # the GLU path's pending gate, where w2 does not read prequantised rows: w13's GEMM
        # then the silu * mul (the same values)
        if glu:
            ff = m.layers[0].feed_forward
            hn = ops.pending_norm(torch.randn(3, cfg.slow.dim).to(torch.bfloat16),
                                  m.layers[0].ffn_norm.weight, 1e-6)
            pend = ops.swiglu(hn, ff.w1.weight, ff.w3.weight)
            assert isinstance(pend, PendingGlu)
            assert torch.equal(ops.dense(pend), plain.swiglu(plain.dense(hn), ff.w1.weight,
                                                              ff.w3.weight))
            dense_w2 = torch.randn(cfg.slow.dim, ff.w2.weight.shape[1]).to(torch.bfloat16)
            assert torch.equal(ops.project(pend, dense_w2), F.linear(ops.dense(pend), dense_w2))
        # a gate nobody quantises is computed as the silu * mul
        ff = m.layers[0].feed_forward
        h = torch.randn(3, cfg.slow.dim).to(torch.bfloat16)
        gate = ops.swiglu(h, ff.w1.weight, ff.w3.weight)
        assert isinstance(gate, PendingGate)
        assert torch.equal(ops.dense(gate), plain.swiglu(h, ff.w1.weight, ff.w3.weight))
        assert torch.equal(ops.project(gate, ff.w2.weight),
                           w8a8(plain.swiglu(h, ff.w1.weight, ff.w3.weight), ff.w2.weight))
        # a residual the GEMM's epilogue cannot read (its last dim strided): added after it
        r = torch.randn(cfg.slow.dim, 3).to(torch.bfloat16).t()
        nw = m.layers[0].ffn_norm.weight
        got, _ = ops.linear_add_rms_norm(gate, ff.w2.weight, r, nw, 1e-6)
        want, _ = plain.linear_add_rms_norm(plain.dense(gate), ff.w2.weight, r, nw, 1e-6)
        assert torch.equal(got, want)


@pytest.mark.cuda
@_cuda
def test_prequant_ops_cuda():
    """The W8A8 fusions on the GPU with a plan whose W8A8 rows are prequantised Triton
    GEMMs: a block's wo (the residual in the W8A8 GEMM's epilogue), the quantising norm into
    the packed w13, the quantising gate into w2 (its residual too) — close to the unfused
    W8A8 reference (the kernels' float32 may move a rounding), and a CUDA graph replay on
    new inputs equal to eager."""
    import dataclasses

    from engine.fusion import packed
    from engine.kernels import fp8_triton as ft
    from engine.ops import Normed, Ops, PendingGate, PendingGlu
    from engine.quant import Fp8Weight, quantize_fp8

    D, F_ = 2560, 1024
    pre = {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4,
           "prequant": True}
    rows = [{"fp8": True, "m": 16, "n": n, "k": k, "impl": "triton_w8a8", "splits": sp,
             "config": pre, "us": {"triton_w8a8:x": 1.0}}
            for n, k, sp in ((D, D, 2), (2 * F_, D, 1), (D, F_, 1))]
    plan = linear.LinearPlan.from_rows(rows)
    def no_linear(a, wt):  # type: ignore[no-untyped-def]
        raise AssertionError(f"a plain linear ran for W {list(wt.shape)}: a fused path declined")

    ops = Ops(packed_ffn=True, prequant=linear.make_prequant(plan, True), linear=no_linear,
              residual_kernel=linear.make_residual(plan, kernels=True, fp8_activations=True))
    glu_ops = dataclasses.replace(ops, glu_quant=linear.make_glu(plan, True))

    def w(n, k, seed):  # type: ignore[no-untyped-def]
        return quantize_fp8(_bf16(n, k, seed=seed, device="cuda").float() / k**0.5)

    wo, w13, w2 = w(D, D, 1), w(2 * F_, D, 2), w(D, F_, 4)
    b = F_ // 128  # W1 and W3: consecutive rows of one buffer, as fusion.pack_ffn lays them
    w1, w3 = Fp8Weight(w13.q[:F_], w13.scale[:b]), Fp8Weight(w13.q[F_:], w13.scale[b:])
    nw = (1 + 0.1 * _bf16(D, seed=5, device="cuda").float()).to(torch.bfloat16)
    y = _bf16(16, D, seed=6, device="cuda")
    x = _bf16(16, D, seed=7, device="cuda")

    def chain(o):  # type: ignore[no-untyped-def]
        h, hn = o.linear_add_rms_norm(y, wo, x, nw, 1e-6)
        gate = o.swiglu(hn, w1, w3)
        return o.linear_add_rms_norm(gate, w2, h, nw, 1e-6)

    def ref_linear(a, wt):  # type: ignore[no-untyped-def]
        return ft.fp8_linear_w8a8_torch(a, wt)

    want = chain(Ops(packed_ffn=True, linear=ref_linear))
    got = chain(ops)
    assert isinstance(got[1], Normed)
    assert isinstance(ops.swiglu(ops.pending_norm(x, nw, 1e-6), w1, w3), PendingGate)
    assert isinstance(glu_ops.swiglu(ops.pending_norm(x, nw, 1e-6), w1, w3), PendingGlu)
    for a, b in ((got[0], want[0]), (ops.dense(got[1]), want[1])):
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
    fused = chain(glu_ops)  # w13's GEMM forms and quantises the gate: the same math
    for a, b in ((fused[0], got[0]), (glu_ops.dense(fused[1]), ops.dense(got[1]))):
        assert (a.float() - b.float()).norm() / b.float().norm() < 1e-2
    assert packed(w1, w3) is not None
    torch.cuda.synchronize()
    for seed, o in ((8, ops), (9, glu_ops)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(o)[0]
        y.copy_(_bf16(16, D, seed=seed, device="cuda"))  # new inputs for each replay
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(o)[0])


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16])
def test_residual_epilogue_and_normed_prologue_cuda(M):
    """The residual epilogue is bit-equal to the kernel's own product plus the add (split K
    through the reduce kernel too, strided residual rows); the normed prologue's rows (an
    identity weight shows them) are functional.rms_norm's up to one bf16 ulp in rare places
    (the float32 sum of squares in another order), and its products (plain, split, SwiGLU,
    strided h rows) are the unfused kernel's on those rows."""
    from engine import functional
    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    for N, K in ((2560, 4096), (40, 48)):
        w = (_bf16(N, K, seed=N, device="cuda").float() / K**0.5).to(torch.bfloat16)
        x = _bf16(M, K, seed=M, device="cuda")
        wide = _bf16(M, N + 24, seed=M + 1, device="cuda")
        for r in (wide[:, :N].contiguous(), wide[:, 16:16 + N]):
            for splits, kwarps, v in ((0, 0, 0), (1, 0, 0), (3, 2, 0), (1, 0, 1), (4, 0, 1)):
                got = linear.gemv_residual(x, w, r, splits=splits, kwarps=kwarps, variant=v)
                want = r + linear.gemv(x, w, splits=splits, kwarps=kwarps, variant=v)
                assert torch.equal(got, want), (N, K, splits, kwarps, v)
    K, eps = 2560, 1e-6
    h = _bf16(M, K, seed=5, device="cuda") * 3
    nw = (1 + 0.1 * _bf16(K, seed=6, device="cuda").float()).to(torch.bfloat16)
    xn = functional.rms_norm(h, nw, eps)
    eye = torch.eye(K, dtype=torch.bfloat16, device="cuda")
    ulps = _ulps_apart(linear.gemv_normed(h, nw, eps, eye), xn)
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 1e-2
    w = (_bf16(1024, K, seed=7, device="cuda").float() / K**0.5).to(torch.bfloat16)
    w13 = (_bf16(2 * 600, K, seed=8, device="cuda").float() / K**0.5).to(torch.bfloat16)
    hwide = torch.zeros(M, K + 64, dtype=torch.bfloat16, device="cuda")
    hwide[:, 32:32 + K] = h
    for hh in (h, hwide[:, 32:32 + K]):
        for splits, kwarps in ((0, 0), (1, 0), (3, 2), (1, 8)):
            got = linear.gemv_normed(hh, nw, eps, w, splits=splits, kwarps=kwarps)
            _assert_linear_close(got, xn, w.float())
            ulps = _ulps_apart(got, linear.gemv(xn, w, splits=splits, kwarps=kwarps))
            assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 2e-2
            got = linear.gemv_normed(hh, nw, eps, w13, glu=True, splits=splits, kwarps=kwarps)
            ulps = _ulps_apart(got, linear.gemv_swiglu(xn, w13, splits=splits, kwarps=kwarps))
            assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 2e-2
    # FP8 weights (the prologue feeding the e4m3 tiles; [W1; W3] with its SwiGLU)
    f8 = quantize_fp8(w)
    f13 = quantize_fp8((_bf16(2 * 640, K, seed=9, device="cuda").float() / K**0.5)
                       .to(torch.bfloat16))
    for hh in (h, hwide[:, 32:32 + K]):
        for splits, kwarps in ((0, 0), (1, 0), (3, 2), (1, 8)):
            got = linear.gemv_normed(hh, nw, eps, f8, splits=splits, kwarps=kwarps)
            ulps = _ulps_apart(got, linear.fp8_gemv(xn, f8, splits=splits, kwarps=kwarps))
            assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 2e-2
            got = linear.gemv_normed(hh, nw, eps, f13, glu=True, splits=splits, kwarps=kwarps)
            ulps = _ulps_apart(got, linear.gemv_swiglu(xn, f13, splits=splits, kwarps=kwarps))
            assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 2e-2


@pytest.mark.cuda
@_cuda
def test_norm_fusion_in_ops_and_graph_replay():
    """make_residual / make_normed with a plan that picks the kernel: Ops.linear_add_rms_norm
    leaves the norm pending and Ops.project / Ops.swiglu take it in their prologue, captured
    in a CUDA graph and replayed on new inputs (the same values as eager); a shape the plan
    leaves to the library gets None (the unfused ops run)."""
    from engine.ops import Normed, Ops

    assert extension_available(), "the CUDA extension did not build"
    D, Q, F = 2560, 4096, 1024
    rows = [{"fp8": False, "m": 4, "n": n, "k": k, "impl": "gemv", "splits": s, "kwarps": 0,
             "variant": 0} for n, k, s in ((D, Q, 2), (Q, D, 1), (2 * F, D, 1))]
    plan = linear.LinearPlan.from_rows(rows)
    ops = Ops(packed_ffn=True, residual_kernel=linear.make_residual(plan, kernels=True),
              normed_kernel=linear.make_normed(plan, kernels=True, max_m=4))
    wo = (_bf16(D, Q, seed=1, device="cuda").float() / Q**0.5).to(torch.bfloat16)
    wq = (_bf16(Q, D, seed=2, device="cuda").float() / D**0.5).to(torch.bfloat16)
    w13 = (_bf16(2 * F, D, seed=3, device="cuda").float() / D**0.5).to(torch.bfloat16)
    nw = _bf16(D, seed=4, device="cuda")
    y = torch.zeros(4, Q, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(4, D, dtype=torch.bfloat16, device="cuda")

    def chain():
        h, hn = ops.linear_add_rms_norm(y, wo, x, nw, 1e-6)
        assert isinstance(hn, Normed)
        return h, ops.project(hn, wq), ops.swiglu(hn, w13[:F], w13[F:])

    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain()
    for seed in (7, 8):
        y.copy_(_bf16(4, Q, seed=seed, device="cuda"))
        x.copy_(_bf16(4, D, seed=seed + 1, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        h = linear.gemv_residual(y, wo, x, splits=2)
        assert torch.equal(outs[0], h)
        assert torch.equal(outs[1], linear.gemv_normed(h, nw, 1e-6, wq, splits=1))
        assert torch.equal(outs[2], linear.gemv_normed(h, nw, 1e-6, w13, glu=True, splits=1))
    # rows past max_m: the norm is computed first (the plan would run the kernel)
    assert linear.make_normed(plan, kernels=True)(_bf16(4, D, device="cuda"), nw, 1e-6, wq,
                                                  False) is None
    big = _bf16(32, Q, device="cuda")  # the library's rows: no kernel, the unfused ops
    assert ops.residual_kernel(big, wo, _bf16(32, D, device="cuda")) is None
    h, hn = ops.linear_add_rms_norm(big, wo, _bf16(32, D, device="cuda"), nw, 1e-6)
    assert isinstance(hn, torch.Tensor)


@pytest.mark.cuda
@_cuda
def test_pdl_launches_change_no_value_eager_or_in_a_graph():
    """A chain of csrc kernels, each reading the one before it (the residual epilogue through
    split K's reduce kernel, the normed prologue, decode attention on the projection's heads
    with split positions and their merge kernel, FP8 [W1; W3]'s SwiGLU epilogue through the
    reduce kernel, a torch op between them, FP8 with split K, the head and the sampler's
    draw), launched with programmatic dependent launch in each of the linears' PDL modes: the
    same values as plain launches, captured in a CUDA graph replayed on new inputs (a kernel
    that read its input before waiting for the kernel before it would read the previous
    replay's values: removing the wait makes this fail)."""
    from engine.quant import quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    B, H, Hkv, D, K, F = 2, 4, 2, 128, 2560, 1024
    _, _, _, kc, vc, table, wb, pos = _attention_case(B, H, Hkv, D, 40, torch.bfloat16, "cuda",
                                                      bs=16)

    def w(n, k, seed):
        return (_bf16(n, k, seed=seed, device="cuda").float() / k**0.5).to(torch.bfloat16)

    wo, wqkv, w13 = w(K, K, 1), w((H + 2 * Hkv) * D, K, 2), quantize_fp8(w(2 * F, H * D, 3))
    w2, head = quantize_fp8(w(K, F, 4)), w(1024, K, 5)
    nw = (1 + 0.1 * _bf16(K, seed=6, device="cuda").float()).to(torch.bfloat16)
    temp = torch.tensor([0.0, 1.0], device="cuda")
    top_p = torch.tensor([1.0, 0.9], device="cuda")
    top_k = torch.tensor([0, 50], device="cuda")
    seed = torch.tensor([3, 4], device="cuda")
    step = torch.tensor([0, 7], device="cuda")
    y = torch.zeros(B, K, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(B, K, dtype=torch.bfloat16, device="cuda")

    def chain(mode):
        h = linear.gemv_residual(y, wo, x, splits=3, pdl=mode)
        qkv = linear.gemv_normed(h, nw, 1e-6, wqkv, pdl=mode)
        q = qkv[:, :H * D].view(B, H, D)
        kn = qkv[:, H * D:(H + Hkv) * D].view(B, Hkv, D)
        vn = qkv[:, (H + Hkv) * D:].view(B, Hkv, D)
        a = attention.decode_attention(q, kn, vn, kc, vc, table, wb, pos, span=40, splits=2,
                                       pdl=bool(mode))
        z = linear.gemv_swiglu(a.view(B, H * D), w13, splits=2, pdl=mode) * 2  # + a torch op
        u = linear.fp8_gemv(z, w2, splits=2, pdl=mode)
        logits = linear.gemv(u, head, pdl=mode)
        ids = sampling.sample_topk(logits, temp, top_p, top_k, seed, step, 0, pdl=bool(mode))
        return h, qkv, a, z, u, logits, ids

    def fill(s):
        y.copy_(_bf16(B, K, seed=s, device="cuda"))
        x.copy_(_bf16(B, K, seed=s + 1, device="cuda"))

    fill(10)
    plain = [t.clone() for t in chain(0)]
    for p, e in zip(plain, chain(1)):
        assert torch.equal(p, e)
    for mode in (1, 2, 3):
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = chain(mode)
        for s in (20, 30, 40):
            fill(s)
            g.replay()
            torch.cuda.synchronize()
            got = [t.clone() for t in outs]
            for p, o in zip(chain(0), got):
                assert torch.equal(p, o), (mode, s)
        del g


# ------------------------------------------------- the attention prologue (the fast AR's wo)
def _attend_case(M, H, Hkv, S, pos, device="cpu", seed=0, rows=None):
    """One position's qkv rows [M, q + 2 kv] (+ 8 columns beyond, so rows are strided like a
    packed projection's), caches [rows, Hkv, S, 128] with positions 0..pos-1 filled, and the
    position's (cos, sin) [64, 2] (engine/functional.py's table)."""
    D = linear.ATTN_HEAD_DIM
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(M, (H + 2 * Hkv) * D + 8, generator=g).to(torch.bfloat16)
    kc = torch.zeros(rows or M, Hkv, S, D).to(torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc[:, :, :pos] = torch.randn(rows or M, Hkv, pos, D, generator=g).to(torch.bfloat16)
    vc[:, :, :pos] = torch.randn(rows or M, Hkv, pos, D, generator=g).to(torch.bfloat16)
    cs = functional.rope_table(S, D, 1e6)[pos].to(torch.bfloat16).contiguous()
    return (wide[:, :(H + 2 * Hkv) * D].to(device), kc.to(device), vc.to(device), cs.to(device))


def test_attend_reference_is_the_fast_kv_attention():
    """attend_reference (rotate, store this position's k/v, softmax over 0..pos in float32)
    against FastKV's own path (functional.norm_rope_qk, the cache write, explicit_attention in
    bf16): the same stored keys and values, outputs within bf16 rounding."""
    from engine.cache import FastKV
    from engine.config import ModelConfig, TransformerConfig, preset

    base = preset("tiny")
    fast = TransformerConfig(n_layer=1, dim=base.slow.dim, n_head=8, n_local_heads=2,
                             head_dim=128,
                             intermediate_size=64, vocab_size=4096, rope_base=1e6,
                             norm_eps=1e-6, max_seq_len=11)
    cfg = ModelConfig(slow=base.slow, fast=fast, ids=base.ids, num_codebooks=10)
    M, H, Hkv, S = 3, 8, 2, 10
    for pos in (0, 4, 9):
        qkv, kc, vc, cs = _attend_case(M, H, Hkv, S, pos, seed=pos)
        kv = FastKV(cfg, M, device="cpu", dtype=torch.bfloat16)
        kv.k[0], kv.v[0] = kc, vc
        q, k = functional.norm_rope_qk(qkv[:, None, :H * 128].reshape(M, 1, H, 128),
                                       qkv[:, None, H * 128:(H + Hkv) * 128].reshape(M, 1, Hkv, 128),
                                       None, None, cs[None, None], 1e-6)
        v = qkv[:, None, (H + Hkv) * 128:].reshape(M, 1, Hkv, 128)
        want = kv.at(pos, M)(0, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        got = linear.attend_reference(qkv, kc, vc, cs, pos, H)
        assert torch.equal(kc, kv.k[0]) and torch.equal(vc, kv.v[0])
        torch.testing.assert_close(got.float(), want[:, :, 0].reshape(M, -1).float(),
                                   rtol=2e-2, atol=2e-2)


def test_gemv_attend_fallback_contract_and_dispatch():
    """Off the kernel gemv_attend is the reference attention, then the linear and the add,
    and checks the kernel's contract by name; make_attend answers None where the kernel does
    not take the call (CPU tensors, too many rows, no plan)."""
    import torch.nn.functional as F

    from engine.quant import fp8_linear_torch, quantize_fp8

    M, H, Hkv, S, pos = 2, 8, 2, 10, 6
    qkv, kc, vc, cs = _attend_case(M, H, Hkv, S, pos)
    w, r = _bf16(96, H * 128, seed=1), _bf16(M, 96, seed=2)
    kc2, vc2 = kc.clone(), vc.clone()
    a = linear.attend_reference(qkv, kc2, vc2, cs, pos, H)
    assert torch.equal(linear.gemv_attend(qkv, kc, vc, cs, pos, w, r), r + F.linear(a, w))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # this position's k/v stored
    assert kc[:, :, pos].abs().sum() > 0 and kc[:, :, pos + 1:].abs().sum() == 0
    f8 = quantize_fp8(_bf16(128, H * 128, seed=3))
    assert torch.equal(linear.gemv_attend(qkv, kc, vc, cs, pos, f8), fp8_linear_torch(a, f8))
    many = _attend_case(17, H, Hkv, S, pos)  # more rows than the prologue holds
    x3 = qkv[None]  # leading dims: [1, M, W] -> [1, M, N]
    assert linear.gemv_attend(x3, kc, vc, cs, pos, w, r[None]).shape == (1, M, 96)
    for args, match in (
            ((qkv.float(), kc, vc, cs, pos, w), "bfloat16"),
            ((qkv, kc[..., :64].contiguous(), vc, cs, pos, w), r"\[B, Hkv, S, 128\]"),
            ((qkv, kc, vc[:, :, :5].contiguous(), cs, pos, w), "differ"),
            ((qkv, kc[:1], vc[:1], cs, pos, w), "fewer than"),
            ((qkv, kc, vc, cs, S, w), "pos must be"),
            ((qkv, kc, vc, cs, True, w), "pos must be"),
            ((qkv, kc, vc, cs.float(), pos, w), "cs must be"),
            ((qkv, kc, vc, cs, pos, _bf16(96, 7 * 128)), "multiple of the caches"),
            ((qkv[:, :-8], kc, vc, cs, pos, w), "must hold q"),
            ((*many, pos, w), "at most 16 rows")):
        with pytest.raises(ValueError, match=match):
            linear.gemv_attend(*args)
    big = torch.zeros(M, Hkv, 33, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"1\.\.32"):
        linear.gemv_attend(qkv, big, big.clone(), cs, pos, w)
    plan = linear.LinearPlan.from_rows(_plan_rows())
    att = linear.make_attend(plan, kernels=True)
    assert att(qkv, kc, vc, cs, pos, w, r) is None  # CPU
    assert linear.make_attend(None, kernels=True)(qkv, kc, vc, cs, pos, w, r) is None
    assert linear.make_attend(plan, kernels=True, max_m=1)(qkv, kc, vc, cs, pos, w, r) is None


def _fast_model(head_dim=128, dtype=torch.bfloat16, device="cpu"):
    """A small DualAR whose fast AR has the prologue's head_dim (the slow AR the tiny one's)."""
    from engine.config import ModelConfig, TransformerConfig, preset
    from engine.model import DualAR

    base = preset("tiny")
    fast = TransformerConfig(n_layer=2, dim=base.slow.dim, n_head=4, n_local_heads=2,
                             head_dim=head_dim, intermediate_size=256, vocab_size=4096,
                             rope_base=1e6, norm_eps=1e-6, max_seq_len=11)
    cfg = ModelConfig(slow=base.slow, fast=fast, ids=base.ids, num_codebooks=10)
    torch.manual_seed(0)
    return DualAR(cfg).to(device=device, dtype=dtype).eval()


def _fast_frame(model, ops, deferred, B=2, device="cpu"):
    """The fast AR's 10 positions for B rows as the runner runs them (positions 0 and 1 in
    one call, then 2..9, from fixed codes) -> (hidden states [9, B, D] of positions 1..9,
    the caches)."""
    from engine.cache import FastKV

    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, 1, model.cfg.slow.dim, generator=g).to(model.fast_norm.weight)
    codes = torch.randint(0, 4096, (9, B), generator=g).to(device)
    kv = FastKV(model.cfg, B, device=device, dtype=h.dtype, deferred=deferred)
    with torch.no_grad():
        x = torch.cat([h.to(device), model.fast_embeddings(codes[0])[:, None]], dim=1)
        out = [ops.dense(model.fast_hidden(x, 0, kv.at(0, B), ops))[:, 1]]
        for j in range(2, 10):
            x = model.fast_embeddings(codes[j - 1])[:, None]
            out.append(ops.dense(model.fast_hidden(x, j, kv.at(j, B), ops))[:, 0])
    return torch.stack(out), kv


def test_model_defers_the_fast_attention_to_wo_prologue():
    """With a deferring FastKV and an attend kernel the fast AR hands every layer's attention
    of positions 2..9 (one position per call; positions 0 and 1 come as one) to wo's
    prologue: the same hidden
    states and caches as the plain path within bf16 rounding (here through the reference
    kernel, `gemv_attend` off the GPU); an attend kernel that declines (None) falls back to
    the plain attention, exactly."""
    from engine.ops import Ops

    model = _fast_model()
    calls = []

    def attend(*a):
        calls.append(a[4])  # pos
        return linear.gemv_attend(*a, kernel=False)

    want, kv0 = _fast_frame(model, Ops(), deferred=False)
    got, kv1 = _fast_frame(model, Ops(attend_kernel=attend), deferred=True)
    n = model.cfg.fast.n_layer
    assert calls == [p for p in range(2, 10) for _ in range(n)]
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(kv1.k.float(), kv0.k.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kv1.v.float(), kv0.v.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(kv1.v[0, :, :, 0], kv0.v[0, :, :, 0])  # the same input: as projected
    declined, _ = _fast_frame(model, Ops(attend_kernel=lambda *a: None), deferred=True)
    assert torch.equal(declined, want)
    from engine.cache import PagedDecodeAttend  # the slow AR's long context: never offered
    assert not hasattr(PagedDecodeAttend, "defer")

    class Probe:  # an attend that offers deferral: qk-norm layers (the slow AR's) never take it
        def defer(self, *a):  # type: ignore[no-untyped-def]
            pytest.fail("deferred a qk-norm layer")

        def __call__(self, layer, q, k, v):  # type: ignore[no-untyped-def]
            return q

    att = model.layers[0].attention
    assert att.cfg.qk_norm
    x = torch.randn(1, 1, model.cfg.slow.dim, dtype=torch.bfloat16)
    y = att.heads(x, model.rope[:1][None], Probe(), 0, Ops())
    assert y.shape == (1, 1, att.cfg.q_size)


@pytest.mark.cuda
@_cuda
@pytest.mark.parametrize("M,H,Hkv,S,pos", [(1, 32, 8, 10, 0), (1, 32, 8, 10, 9), (2, 32, 8, 10, 5),
                                           (2, 32, 8, 10, 1), (4, 8, 2, 32, 31),
                                           (3, 16, 16, 12, 7)])
def test_attention_prologue_cuda(M, H, Hkv, S, pos):
    """csrc's attention prologue: its rows (an identity W shows them) are attend_reference's
    within 2 bf16 ulps (float32 sums in another order, the hardware exp) in rare places, the
    stored key and value are the reference's exactly; its products (split K, kwarps, the
    residual epilogue, FP8 W) are the plain kernel's on the reference rows; only row m's
    position `pos` is written; rows beyond M and other positions are untouched."""
    from engine.quant import dequantize_fp8, quantize_fp8

    assert extension_available(), "the CUDA extension did not build"
    K = H * 128
    qkv, kc, vc, cs = _attend_case(M, H, Hkv, S, pos, device="cuda", seed=pos, rows=M + 1)
    kr, vr = kc.clone(), vc.clone()
    want = linear.attend_reference(qkv, kr, vr, cs, pos, H)
    eye = torch.eye(K, dtype=torch.bfloat16, device="cuda")
    k1, v1 = kc.clone(), vc.clone()
    got = linear.gemv_attend(qkv, k1, v1, cs, pos, eye)
    assert torch.equal(k1, kr) and torch.equal(v1, vr)
    ulps = _ulps_apart(got, want)
    assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 2e-2
    N = 2560
    w = (_bf16(N, K, seed=3, device="cuda").float() / K**0.5).to(torch.bfloat16)
    r = _bf16(M, N, seed=4, device="cuda")
    f8 = quantize_fp8(w)
    for splits, kwarps in ((0, 0), (1, 0), (3, 2), (1, 8)):
        for ww in (w, f8):
            got = linear.gemv_attend(qkv, kc.clone(), vc.clone(), cs, pos, ww, r,
                                     splits=splits, kwarps=kwarps)
            base = (linear.fp8_gemv(want, ww, splits=splits, kwarps=kwarps)
                    if ww is f8 else linear.gemv(want, ww, splits=splits, kwarps=kwarps))
            # the prologue's rows are the reference's to 2 ulps in rare places: the products
            # differ by at most that through |x| |w| (plus the output's and the add's rounding)
            wf = dequantize_fp8(ww) if ww is f8 else ww.float()
            bound = (2**-6 * (want.float().abs() @ wf.abs().t())
                     + 2**-7 * (r.float() + base.float()).abs())
            err = (got.float() - (r + base).float()).abs()
            assert bool((err <= bound + 1e-6).all()), (splits, kwarps, ww is f8, float(err.max()))
            assert float((got != r + base).float().mean()) < 5e-2


@pytest.mark.cuda
@_cuda
def test_model_fast_attention_prologue_cuda():
    """The fast AR with csrc's attention prologue against the plain path (csrc's decode
    attention kernel with its RoPE): the same hidden states and caches within bf16 rounding,
    every deferrable layer taken by the kernel."""
    from engine.ops import Ops

    assert extension_available(), "the CUDA extension did not build"
    model = _fast_model(device="cuda")
    taken = []

    def attend(*a):
        y = linear.gemv_attend(*a)
        taken.append(y is not None)
        return y

    want, kv0 = _fast_frame(model, Ops(), deferred=False, device="cuda")
    got, kv1 = _fast_frame(model, Ops(attend_kernel=attend), deferred=True, device="cuda")
    assert taken and all(taken)
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(kv1.k.float(), kv0.k.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kv1.v.float(), kv0.v.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(kv1.v[0, :, :, 0], kv0.v[0, :, :, 0])


def _graphs_called_once(monkeypatch, us: float) -> list[int]:
    """linear_bench's graph timings off the GPU: each graph's calls run once, every timing
    is `us`; returns the list each timing appends its number of calls to."""
    from bench_latency import linear_bench as lb

    timed: list[int] = []

    def once(calls, reps):  # type: ignore[no-untyped-def]
        timed.append(len(calls))
        for c in calls:
            c()
        return us

    monkeypatch.setattr(lb, "graph_us", once)
    return timed


def test_linear_bench_attend_times_both_paths_on_the_same_inputs(monkeypatch):
    """linear_bench --attend's timings, off the GPU with every graph replaced by one call of
    each function (the kernels' fallbacks): both paths run on the same inputs and agree (two
    float32 attentions: equal here but for a rounding), each part is timed."""
    from bench_latency import linear_bench as lb

    timed = _graphs_called_once(monkeypatch, 1.0)
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(64, 4096, generator=g) / 64).to(torch.bfloat16) for _ in range(2)]
    tiny = ws[0][:16].contiguous()
    kw = {"splits": 1, "kwarps": 8, "pdl": 0}
    res = lb._attend_timings(2, 9, ws, tiny, {**kw, "variant": 0}, kw, reps=1, pdl=0, g=g)
    assert timed == [2, 2, 2, 2, 2]
    assert set(res) >= {"unfused_us", "fused_us", "attention_us", "wo_us",
                        "prologue_16_rows_us"}
    assert res["max_ulps"] <= 2 and res["differing"] < 0.01


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="the compiled quantize_rows needs a C++ compiler on the CPU")
def test_linear_bench_rowwise_times_dense_and_w8a8_on_the_same_weights(monkeypatch):
    """linear_bench --rowwise off the GPU (every graph one call of each function; torch's
    CPU _scaled_mm): the dense GEMM, the rowwise W8A8 path (its compiled per-row quantisation
    agreeing with the torch reference) and the GEMM alone are timed over every weight copy,
    with each one's error against the block-scaled FP8 product: the dense one at bf16
    rounding, the W8A8 one larger (two roundings of W, one of x) but bounded."""
    from bench_latency import linear_bench as lb

    timed = _graphs_called_once(monkeypatch, 2.0)
    rows = lb.bench_rowwise(["t"], (16, 3), 1, 1000.0, device="cpu", shapes={"t": (256, 384)},
                            rotate_bytes=4 * 256 * 384)
    assert [r["m"] for r in rows] == [16, 3]
    for r in rows:
        assert "rowwise_error" not in r, r
        assert r["rowwise_agrees"] is True
        assert r["dense_rel_err"] < 0.01 < r["rowwise_rel_err"] < 0.08
        assert r["dense_us"] == r["rowwise_us"] == r["rowwise_gemm_us"] == 2.0
        assert r["rowwise_copy_pct"] < r["dense_copy_pct"]  # half the weight bytes, same time
    assert timed == [2, 4, 4] * 2  # every copy: 2 dense, 4 FP8 (half the bytes each)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 5, 16, 64, 200])
def test_rowwise_w8a8_cuda_matches_its_reference(m):
    """torch._scaled_mm's rowwise-scaled FP8 GEMM (what `fp8_rowwise_linear` runs on CUDA,
    with the compiled per-row quantisation as the engine runs it, and a packed W1|W3 view)
    against the same roundings dequantised and multiplied in float32, at one row, odd rows
    and prefill sizes, in a CUDA graph too."""
    from engine import fusion
    from engine.quant import (
        Fp8Weight,
        fp8_rowwise_linear,
        fp8_rowwise_linear_torch,
        quantize_fp8,
        quantize_rows,
        rowwise_fp8,
    )

    quant = fusion.compiled("quantize_rows", quantize_rows)
    k, n = 2560, 2 * 1024
    w = quantize_fp8((_bf16(n, k, seed=3, device="cuda").float() / k**0.5).to(torch.bfloat16))
    wq, ws = rowwise_fp8(w)
    x = _bf16(m, k, seed=m, device="cuda") * 3
    want = fp8_rowwise_linear_torch(x, wq, ws)
    for q in (quantize_rows, quant):
        got = fp8_rowwise_linear(x, wq, ws, quantize=q)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err = (got.float() - want.float()).abs()
        assert bool((err <= 2**-7 * want.float().abs() + 1e-2 * want.float().abs().mean()).all())
    half = fusion.packed(Fp8Weight(w.q[: n // 2], w.scale[: n // 2 // 128], None,
                                   (wq[: n // 2], ws[: n // 2])),
                         Fp8Weight(w.q[n // 2:], w.scale[n // 2 // 128:], None,
                                   (wq[n // 2:], ws[n // 2:])))
    assert half is not None and half.rowwise is not None
    assert torch.equal(fp8_rowwise_linear(x, *half.rowwise, quantize=quant),
                       fp8_rowwise_linear(x, wq, ws, quantize=quant))
    static = x.clone()
    fp8_rowwise_linear(static, wq, ws, quantize=quant)  # warm outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp8_rowwise_linear(static, wq, ws, quantize=quant)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_rowwise_linear(x, wq, ws, quantize=quant))


def test_rowwise_fp8_requantises_each_row_and_matches_its_reference():
    """`rowwise_fp8`: one scale per row (its largest |W| / 448: the row's largest value is
    +-448 exactly), values within e4m3's rounding of the block-scaled weight, the same in
    chunks of rows as at once; `fp8_rowwise_linear` (CPU _scaled_mm) equals its torch
    reference to the output's rounding."""
    from engine.quant import (
        FP8_MAX,
        dequantize_fp8,
        fp8_rowwise_linear,
        fp8_rowwise_linear_torch,
        quantize_fp8,
        rowwise_fp8,
    )

    g = torch.Generator().manual_seed(3)
    w = torch.randn(384, 320, generator=g) * torch.logspace(-2, 1, 384)[:, None]
    f8 = quantize_fp8(w)
    q, s = rowwise_fp8(f8)
    assert q.shape == (384, 320) and s.shape == (384,) and s.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((384,), FP8_MAX))
    d = dequantize_fp8(f8)
    assert bool(((q.float() * s[:, None] - d).abs() <= 2**-4 * d.abs() + 2**-9 * s[:, None]).all())
    q2, s2 = rowwise_fp8(f8, rows=128)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    x = torch.randn(2, 5, 320, generator=g).to(torch.bfloat16)
    y = fp8_rowwise_linear(x, q, s)
    assert y.shape == (2, 5, 384) and y.dtype == torch.bfloat16
    ref = fp8_rowwise_linear_torch(x, q, s)
    assert bool(((y.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-3).all())


def test_linear_ncu_script_cases():
    """scripts/linear_ncu.py (the launches PERF.md's Nsight Compute figures come from): its
    cases name a dtype, a shape of linear_bench's, M, variant and kwarps; a bad one is named;
    without a CUDA device and the extension it says so (exit 2) instead of profiling
    nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    sys.path.insert(0, str(root / "scripts"))
    try:
        import linear_ncu
    finally:
        sys.path.pop(0)
    assert linear_ncu.parse("fp8:w13:1:4:1,bf16:wqkv:2:0:8") == [
        (True, "w13", 1, 4, 1), (False, "wqkv", 2, 0, 8)]
    for bad in ("fp8:w99:1:0:1", "fp16:w13:1:0:1", "fp8:w13:1:0", "fp8:w13:one:0:1"):
        with pytest.raises(SystemExit, match="bad case"):
            linear_ncu.parse(bad)
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, "scripts/linear_ncu.py"], capture_output=True,
                             text=True, timeout=120, cwd=root,
                             env={**os.environ, "PYTHONPATH": "."})
        assert run.returncode == 2 and "needs a CUDA device" in run.stderr
