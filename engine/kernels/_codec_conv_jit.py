"""The Triton programs of engine/kernels/codec_conv.py (that module's docstring says what
they compute), at module level so that they share their implicit-GEMM main loop and Snake as
jit functions (Triton resolves the names a kernel calls among its module's globals; it inlines
them, so each program compiles as if written out). Imported only by codec_conv's `_kernel` /
`_unit_kernel`: importing codec_conv needs no triton."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rows(rm, M, T, sxb, sxt):
    """Output rows rm = b * T + t -> (whether each is a row, b, t, its input row's offset
    b * sxb + t * sxt); rows past the end read row 0 and are not stored."""
    row_ok = rm < M
    rmc = tl.where(row_ok, rm, 0)
    b = rmc // T
    t = rmc - b * T
    return row_ok, b, t, b.to(tl.int64) * sxb + t.to(tl.int64) * sxt


@triton.jit
def tap_dot(x_ptr, w_ptr, a_row, s_tap, C, NP, cols, TAPS: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):
    """[BM, BN] float32: the conv's reduction over (tap, input channel) for the rows whose
    input starts at a_row and the output channels `cols` of the taps [TAPS * C, NP]: tap j of
    row t reads input row t + j * dilation (s_tap = dilation * sxt elements on; BK divides C)."""
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, TAPS * C, BK):  # (tap, channel block)
        j = kk // C
        c0 = kk - j * C
        a = tl.load(x_ptr + a_row[:, None] + j * s_tap + (c0 + rk)[None, :])
        w = tl.load(w_ptr + (kk + rk)[:, None] * NP + cols[None, :])
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def snake(v, al, FAST_SIN: tl.constexpr):
    """v + sin(alpha v)^2 / (alpha + 1e-9), alpha per column; FAST_SIN: the hardware sine."""
    if FAST_SIN:
        s = libdevice.fast_sinf(al[None, :] * v)
    else:
        s = tl.sin(al[None, :] * v)
    return v + (1.0 / (al + 1e-9))[None, :] * (s * s)


@triton.jit(do_not_specialize=["M", "T"])
def unit_kernel(x_ptr, w7_ptr, b7_ptr, a_ptr, w1_ptr, b1_ptr, r_ptr, o_ptr, M, T, C, NP,
                s_tap, sxb, sxt, srb, srt, TAPS: tl.constexpr, FAST_SIN: tl.constexpr,
                BM: tl.constexpr, NPC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # one program per BM output rows (stream b, time t) = b * T + t, every channel
    pid = tl.program_id(0)
    rm = pid * BM + tl.arange(0, BM)
    rc = tl.arange(0, NPC)  # the k=7 conv's output channels (padded to a power of two)
    row_ok, b, t, a_row = rows(rm, M, T, sxb, sxt)
    # h: [BM, NPC] = snake(conv7(xx) + b7)
    acc = tap_dot(x_ptr, w7_ptr, a_row, s_tap, C, NP, rc, TAPS, BM, NPC, BK)
    c_ok = rc < C
    v = acc + tl.load(b7_ptr + rc, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    al = tl.load(a_ptr + rc, mask=c_ok, other=1.0).to(tl.float32)
    h = snake(v, al, FAST_SIN).to(o_ptr.dtype.element_ty)  # rounded as the two-launch path
    r_row = b.to(tl.int64) * srb + t.to(tl.int64) * srt
    # out = x + (h @ W1 + b1), BN output channels at a time (W1's padded rows read as 0)
    for n0 in tl.static_range(0, NPC, BN):
        rn = n0 + tl.arange(0, BN)
        n_ok = rn < C
        w1 = tl.load(w1_ptr + rc[:, None] * NP + rn[None, :], mask=c_ok[:, None],
                     other=0.0)
        y = tl.dot(h, w1) + tl.load(b1_ptr + rn, mask=n_ok,
                                    other=0.0).to(tl.float32)[None, :]
        ok = row_ok[:, None] & n_ok[None, :]
        res = tl.load(r_ptr + r_row[:, None] + rn[None, :], mask=ok, other=0.0)
        tl.store(o_ptr + rm.to(tl.int64)[:, None] * C + rn[None, :],
                 (res.to(tl.float32) + y).to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "T"])
def conv_kernel(x_ptr, w_ptr, b_ptr, a_ptr, r_ptr, o_ptr, s_ptr, M, T, N, C, NP, s_tap,
                sxb, sxt, srb, srt, ssb, s_off, TAPS: tl.constexpr, EPI: tl.constexpr,
                FAST_SIN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    # output tiles in row-major order with the channel tiles fastest: the programs that
    # run together read the same input rows (from L2) and the whole weight stays in L2
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    rm = pid_m * BM + tl.arange(0, BM)  # output rows: (stream b, time t) = b * T + t
    rn = pid_n * BN + tl.arange(0, BN)  # output channels (taps are padded: no mask)
    # x: [B, P + T, C] rows
    row_ok, b, t, a_row = rows(rm, M, T, sxb, sxt)
    acc = tap_dot(x_ptr, w_ptr, a_row, s_tap, C, NP, rn, TAPS, BM, BN, BK)
    n_ok = rn < N
    v = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if EPI == 1:  # Snake
        v = snake(v, tl.load(a_ptr + rn, mask=n_ok, other=1.0).to(tl.float32), FAST_SIN)
    elif EPI >= 2:  # the residual sum x + (y + bias)
        r_row = b.to(tl.int64) * srb + t.to(tl.int64) * srt
        res = tl.load(r_ptr + r_row[:, None] + rn[None, :],
                      mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        v = res.to(tl.float32) + v
    y = v.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], y,
             mask=row_ok[:, None] & n_ok[None, :])
    if EPI == 3:  # and the next Snake of the rounded sum into the next conv's input
        al = tl.load(a_ptr + rn, mask=n_ok, other=1.0).to(tl.float32)
        sv = snake(y.to(tl.float32), al, FAST_SIN)
        s_row = b.to(tl.int64) * ssb + (s_off + t).to(tl.int64) * N
        tl.store(s_ptr + s_row[:, None] + rn[None, :], sv.to(s_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])
