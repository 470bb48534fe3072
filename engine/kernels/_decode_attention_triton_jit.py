"""The Triton programs of engine/kernels/decode_attention_triton.py (that module's docstring
says what they compute), at module level so that one jit function can call another (Triton
resolves the names a kernel calls among its module's globals). Imported only by
`decode_attention_triton._kernels`: importing the wrapper needs no triton. The names carry
"decode_attention" (and the merge "combine", as csrc's) for the profiles' kernel categories."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_rope(x, w_ptr, cs_ptr, eps, D: tl.constexpr, DP: tl.constexpr,
              NORM: tl.constexpr):
    # x: [R, DP] float32 (the dtype's values, zeros past D) -> RMSNorm (NORM) and the
    # interleaved rotation, rounded to the dtype where functional.norm_rope_qk rounds
    R: tl.constexpr = x.shape[0]
    dt = cs_ptr.dtype.element_ty
    rd = tl.arange(0, DP)
    if NORM:
        ss = tl.sum(x * x, 1)
        r = tl.math.rsqrt(ss * (1.0 / D) + eps)
        x = (x * r[:, None]).to(dt).to(tl.float32)
        wt = tl.load(w_ptr + rd, mask=rd < D, other=0.0).to(tl.float32)
        x = (x * wt[None, :]).to(dt).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (R, DP // 2, 2)))
    ri = tl.arange(0, DP // 2)
    c = tl.load(cs_ptr + 2 * ri, mask=ri < D // 2, other=0.0).to(tl.float32)[None, :]
    sn = tl.load(cs_ptr + 2 * ri + 1, mask=ri < D // 2, other=0.0).to(tl.float32)[None, :]
    y0 = (x0 * c - x1 * sn).to(dt).to(tl.float32)
    y1 = (x1 * c + x0 * sn).to(dt).to(tl.float32)
    return tl.reshape(tl.join(y0, y1), (R, DP))


@triton.jit
def attend_pages(q, kc_ptr, vc_ptr, tab_row, t_begin, t_end, lim, g, Hkv, scale,
                 D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                 LIMIT: tl.constexpr):
    # q: [M, DP] query rows against kv head g's keys/values at positions [t_begin, t_end)
    # through the page-table row tab_row (pointer) -> the online softmax state (m [M],
    # l [M], acc [M, DP]), float32, scores in log2 units (scale folds log2 e). LIMIT: query
    # row i reads only positions < lim[i] (a row then may see none: its state stays empty).
    # A tile lies in one page (BT divides BS, tiles start at multiples of BT). Its page
    # number is loaded one tile ahead: a tile's key/value addresses then depend on no load
    # of the same iteration, so the pipeliner keeps several tiles in flight (with the page
    # loaded in the iteration that uses it, Triton 3.5/3.6 keep one buffer).
    M: tl.constexpr = q.shape[0]
    rd = tl.arange(0, DP)
    rt = tl.arange(0, BT)
    d_ok = rd < D
    m_i = tl.full((M,), float("-inf"), tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, DP), tl.float32)
    blk = tl.load(tab_row + t_begin // BS, mask=t_begin < t_end, other=0).to(tl.int64)
    for t0 in range(t_begin, t_end, BT):
        here = blk
        blk = tl.load(tab_row + (t0 + BT) // BS, mask=t0 + BT < t_end, other=0).to(tl.int64)
        base = ((here * Hkv + g) * BS + t0 % BS) * D
        ok = t0 + rt < t_end
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + base + rt[:, None] * D + rd[None, :], mask=kv_ok,
                    other=0.0)  # [BT, DP]
        s = tl.dot(q, tl.trans(k)) * scale  # [M, BT]
        if LIMIT:
            s = tl.where(ok[None, :] & ((t0 + rt)[None, :] < lim[:, None]), s,
                         float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet
        else:  # every row sees the tile's first position
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(vc_ptr + base + rt[:, None] * D + rd[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def decode_attention_tiles(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, tab_ptr, wb_ptr, pos_ptr, o_ptr,
           ws_o_ptr, ws_ml_ptr, cs_ptr, qw_ptr, kw_ptr, st_ptr, q_rs, kn_rs, vn_rs, o_rs,
           tab_rs, Hkv, cs_rs, scale, eps,
           REP: tl.constexpr, QMR: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
           BS: tl.constexpr, BT: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr,
           SLOTS: tl.constexpr):
    # ROPE: 0 none; 1 the rotation of q and k_new first (cs); 2 their RMSNorm, then it.
    # SLOTS > SPLITS (shared prefixes): row b reads only its positions from st[b] on (the
    # first position after its shared prefix, 0 for none); its prefix's softmax states
    # come from decode_attention_prefix_tiles in workspace slots SPLITS.. (marked empty
    # here where the row has no prefix)
    # one program per (row b, kv head g, split): query heads g * REP .. as dot rows
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    rh = tl.arange(0, QMR)
    rd = tl.arange(0, DP)  # head dims, padded to a power of two (read as 0)
    h_ok = rh < REP
    d_ok = rd < D
    heads = g * REP + rh
    p = tl.load(pos_ptr + b)
    q = tl.load(q_ptr + b * q_rs + heads[:, None] * D + rd[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [QM, DP]
    kx = tl.load(kn_ptr + b * kn_rs + g * D + rd, mask=d_ok, other=0.0)
    vx = tl.load(vn_ptr + b * vn_rs + g * D + rd, mask=d_ok, other=0.0)
    if ROPE > 0:  # padded heads stay 0: their norm is 0 times a finite rsqrt(eps)
        csr = cs_ptr + b * cs_rs
        q = norm_rope(q.to(tl.float32), qw_ptr, csr, eps, D, DP,
                      ROPE == 2).to(q_ptr.dtype.element_ty)
        kx = tl.reshape(norm_rope(tl.reshape(kx.to(tl.float32), (1, DP)), kw_ptr, csr,
                                  eps, D, DP, ROPE == 2),
                        (DP,)).to(kn_ptr.dtype.element_ty)
    # this split's positions [t_begin, t_end) of lo..p, in whole tiles (lo: a multiple of
    # the cache's block size, or p itself: then only position p)
    if SLOTS > SPLITS:
        st = tl.load(st_ptr + b).to(p.dtype)
        lo = tl.minimum(st, p)
    else:
        lo = p * 0
    n = p + 1 - lo
    chunk = tl.cdiv(tl.cdiv(n, SPLITS), BT) * BT
    t_begin = lo + tl.minimum(n, sp * chunk)
    t_end = tl.minimum(p + 1, t_begin + chunk)
    c_end = tl.minimum(t_end, p)  # positions read from the cache (p comes from k_new)
    m_i, l_i, acc = attend_pages(q, kc_ptr, vc_ptr, tab_ptr + b * tab_rs, t_begin, c_end, p,
                                 g, Hkv, scale, D, DP, BS, BT, False)
    if (p >= t_begin) & (p < t_end):  # position p, from k_new / v_new
        s1 = tl.sum(q.to(tl.float32) * kx.to(tl.float32)[None, :], 1) * scale  # [QM]
        m_new = tl.maximum(m_i, s1)
        alpha = tl.exp2(m_i - m_new)
        p1 = tl.exp2(s1 - m_new)
        l_i = l_i * alpha + p1
        acc = acc * alpha[:, None] + p1[:, None] * vx.to(tl.float32)[None, :]
        m_i = m_new
    if sp == 0:  # store position p (every program of this row reads it from k_new)
        w = ((tl.load(wb_ptr + b) * Hkv + g) * BS + p % BS) * D
        tl.store(kc_ptr + w + rd, kx, mask=d_ok)
        tl.store(vc_ptr + w + rd, vx, mask=d_ok)
    if SLOTS == 1:
        o = acc / l_i[:, None]
        tl.store(o_ptr + b * o_rs + heads[:, None] * D + rd[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    else:
        H = Hkv * REP
        row = (b * H + heads) * SLOTS + sp  # [QM]
        tl.store(ws_o_ptr + row[:, None] * D + rd[None, :], acc,
                 mask=h_ok[:, None] & d_ok[None, :])
        tl.store(ws_ml_ptr + row * 2, m_i, mask=h_ok)
        tl.store(ws_ml_ptr + row * 2 + 1, l_i, mask=h_ok)
        if SLOTS > SPLITS:
            if (sp == 0) & (st == 0):  # no shared prefix: its slots hold nothing
                for s2 in tl.static_range(SPLITS, SLOTS):
                    e = (b * H + heads) * SLOTS + s2
                    tl.store(ws_ml_ptr + e * 2, tl.full((QMR,), float("-inf"), tl.float32),
                             mask=h_ok)


@triton.jit
def decode_attention_prefix_tiles(q_ptr, kc_ptr, vc_ptr, tab_ptr, pos_ptr, tr_ptr, tlen_ptr,
                                  ts_ptr, ws_o_ptr, ws_ml_ptr, q_rs, tab_rs, Hkv, B, scale,
                                  REP: tl.constexpr, RT: tl.constexpr, QMP: tl.constexpr,
                                  D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                                  BT: tl.constexpr, SPLITS: tl.constexpr,
                                  SLOTS: tl.constexpr, PSPLITS: tl.constexpr):
    # one program per (tile, kv head g, prefix split ps): the tile's rows share positions
    # [0, L) (the same blocks: tab[src]'s first L / BS entries), so their query heads
    # g * REP .. — RT rows x REP heads, padded to QMP — are the rows of one dot against
    # each key/value tile of that range, read once for the RT rows. Each (row, head)'s
    # softmax state over this split's part of [0, L) goes to workspace slot SPLITS + ps.
    t = tl.program_id(0)
    g = tl.program_id(1)
    ps = tl.program_id(2)
    L = tl.load(tlen_ptr + t).to(tl.int64)
    src = tl.load(ts_ptr + t).to(tl.int64)  # the tile's lowest row: none of the call's if >= B
    if (L > 0) & (src < B):
        ri = tl.arange(0, QMP)
        slot = ri // REP  # the tile row of query row ri, its head g * REP + ri % REP
        row = tl.load(tr_ptr + t * RT + slot, mask=slot < RT, other=-1).to(tl.int64)
        r_ok = (slot < RT) & (row >= 0) & (row < B)
        row = tl.where(r_ok, row, 0)
        head = g * REP + ri % REP
        rd = tl.arange(0, DP)
        d_ok = rd < D
        q = tl.load(q_ptr + row[:, None] * q_rs + head[:, None] * D + rd[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [QMP, DP]
        # each row reads only below its own position (a plan that claimed more than a
        # row has written would otherwise read its future)
        pr = tl.load(pos_ptr + row, mask=r_ok, other=0)  # [QMP]
        chunk = tl.cdiv(tl.cdiv(L, PSPLITS), BT) * BT
        t_begin = tl.minimum(L, ps * chunk)
        t_end = tl.minimum(L, t_begin + chunk)
        m_i, l_i, acc = attend_pages(q, kc_ptr, vc_ptr, tab_ptr + src * tab_rs, t_begin,
                                     t_end, pr, g, Hkv, scale, D, DP, BS, BT, True)
        H = Hkv * REP
        e = (row * H + head) * SLOTS + SPLITS + ps  # [QMP]
        tl.store(ws_o_ptr + e[:, None] * D + rd[None, :], acc,
                 mask=r_ok[:, None] & d_ok[None, :])
        tl.store(ws_ml_ptr + e * 2, m_i, mask=r_ok)
        tl.store(ws_ml_ptr + e * 2 + 1, l_i, mask=r_ok)


@triton.jit
def decode_attention_combine_tiles(ws_o_ptr, ws_ml_ptr, o_ptr, o_rs, H, D: tl.constexpr, DP: tl.constexpr,
            SPLITS: tl.constexpr, SP: tl.constexpr):
    # one program per (row b, head h): merge its SPLITS workspace slots' softmax states in
    # slot order (an empty slot, m = -inf, adds nothing; its o and l are not read)
    b = tl.program_id(0)
    h = tl.program_id(1)
    rs = tl.arange(0, SP)
    rd = tl.arange(0, DP)
    d_ok = rd < D
    s_ok = rs < SPLITS
    row = (b * H + h) * SPLITS + rs
    m = tl.load(ws_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    live = s_ok & (m > float("-inf"))
    ls = tl.load(ws_ml_ptr + row * 2 + 1, mask=live, other=0.0)
    mx = tl.max(m, 0)  # finite: the split holding position p is never empty
    wgt = tl.where(live, tl.exp2(m - mx), 0.0)
    o = tl.load(ws_o_ptr + row[:, None] * D + rd[None, :],
                mask=live[:, None] & d_ok[None, :], other=0.0)
    tot = tl.sum(o * wgt[:, None], 0) / tl.sum(ls * wgt, 0)
    tl.store(o_ptr + b * o_rs + h * D + rd, tot.to(o_ptr.dtype.element_ty), mask=d_ok)
