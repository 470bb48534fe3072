"""csrc's (and the Triton q/k norm + RoPE) kernels against their torch fallbacks, on this machine (CUDA-event-free wall timing
after a warm-up, synchronised):

    python -m bench_latency.kernel_bench

Shapes are S2-Pro's decode shapes (32 query heads, 8 kv heads, head_dim 128; a main-token
draw over 4,097 logits) and the codec's widest streaming shapes (64 streams x 8 frames).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine import functional, fusion
from engine.bookkeeping import Bookkeeping
from engine.kernels import decode_attention_triton as attn_triton
from engine.kernels import extension_available, step_book
from engine.kernels.activation import (
    bias_residual,
    bias_residual_torch,
    snake,
    snake_cat,
    snake_cat_torch,
    snake_torch,
)
from engine.kernels.decode_attention import decode_attention, decode_attention_torch
from engine.kernels.prev_tokens import prev_tokens_shift_inplace, prev_tokens_shift_torch
from engine.kernels.qk_rope import norm_rope_qk
from engine.kernels.sampling import sample, sample_topk, sample_topk_embed


def timed(fn: Callable[..., object], args: tuple, n: int, cuda: bool) -> float:
    """Microseconds per call of fn(*args), after 5 warm-up calls."""
    for _ in range(5):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / n


def graph_us(fn: Callable[..., object], args: tuple, calls: int = 20, reps: int = 10) -> float:
    """Microseconds per call of fn(*args) on the GPU: `calls` calls captured in one CUDA
    graph (compiled and warmed first), replayed `reps` times — no host launch cost, which
    for a Triton launch from Python exceeds a small kernel's time."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(*args)
    g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return 1000 * e0.elapsed_time(e1) / (calls * reps)


def _slow_attention_case(bs: int, pos: int, shared: int = 0) -> tuple[torch.Tensor, ...]:
    """The slow AR's decode attention inputs (S2-Pro heads, bf16, CUDA) for `bs` rows at
    position `pos`: the pool's 64-position blocks shuffled, every row's first `shared`
    blocks row 0's (one voice's prompt). (q, k_new, v_new, k_cache, v_cache, table,
    wblock, pos)."""
    dt, BS = torch.bfloat16, 64
    mb = -(-(pos + 1) // BS)
    q = torch.randn(bs, 32, 128, device="cuda", dtype=dt)
    kn, vn = (torch.randn(bs, 8, 128, device="cuda", dtype=dt) for _ in range(2))
    kc, vc = (torch.randn(bs * mb + 1, 8, BS, 128, device="cuda", dtype=dt) for _ in range(2))
    table = torch.randperm(bs * mb, device="cuda").view(bs, mb)
    table[:, :shared] = table[0, :shared]
    ps = torch.full((bs,), pos, device="cuda")
    ws = table[:, pos // BS].contiguous()
    return q, kn, vn, kc, vc, table, ws, ps


def _time_attention_runs(label: str, bs: int, pos: int,
                         runs: list[tuple[str, Callable[..., object]]], args: tuple,
                         kv_bytes: int) -> None:
    """One line per run: graph-timed microseconds and GB/s over `kv_bytes`."""
    for name, fn in runs:
        try:
            us = graph_us(fn, args)
        except Exception as e:  # a launch shape this GPU cannot take: say so, go on
            print(f"{label} bs={bs:3d} pos={pos:5d} {name:18s} failed: "
                  f"{type(e).__name__}: {str(e)[:160]}")
            continue
        print(f"{label} bs={bs:3d} pos={pos:5d} {name:18s} {us:9.2f} us "
              f"{kv_bytes / us / 1e3:7.1f} GB/s")


def bench_attention_many_rows() -> None:
    """The slow AR's decode attention at 1-256 rows (S2-Pro heads, the pool's 64-position
    blocks shuffled): csrc's kernel (one block per row's positions, and split) against the
    Triton kernel (automatic splits, then launch shapes; at 1-2 rows both also with the
    fused q/k norm + RoPE, as the engine runs them there), graph-timed, with the bandwidth
    over the keys and values each call reads (CUDA only)."""
    from engine.functional import rope_table
    from engine.kernels.decode_attention import Rope

    dt = torch.bfloat16
    for bs, pos in ((1, 200), (1, 1000), (2, 200), (16, 200), (64, 200), (64, 1000),
                    (256, 600)):
        args = _slow_attention_case(bs, pos)
        kv_bytes = 2 * bs * (pos + 1) * 8 * 128 * dt.itemsize
        runs: list[tuple[str, Callable[..., object]]] = []
        if extension_available():
            runs += [("csrc", lambda *a, n=pos + 1: decode_attention(*a, n, splits=1)),
                     ("csrc-split", lambda *a, n=pos + 1: decode_attention(*a, n, splits=0))]
        if attn_triton.available():
            runs.append(("triton", attn_triton.decode_attention_triton))
            for cfg in (attn_triton.Config(32, 4, 3), attn_triton.Config(64, 4, 2),
                        attn_triton.Config(64, 8, 3), attn_triton.Config(64, 4, 4),
                        attn_triton.Config(64, 4, 5)):
                runs.append((f"triton:t{cfg.block_t}w{cfg.warps}s{cfg.stages}",
                             lambda *a, c=cfg: attn_triton.decode_attention_triton(*a,
                                                                                   config=c)))
            runs += [(f"triton-s{sp}", lambda *a, sp=sp: attn_triton.decode_attention_triton(
                *a, splits=sp)) for sp in (1, 2, 4)]
        if bs <= 2:  # one speaking turn's buckets: csrc's attention there folds the q/k norm
            # and RoPE in (decode_rope), so the Triton kernel with its own fold beside it
            w = torch.ones(128, device="cuda", dtype=dt)
            cs = rope_table(pos + 1, 128, 1e6).to("cuda")[pos:pos + 1]
            rope = Rope(w, w, cs, 1e-6)
            if extension_available():
                runs.append(("csrc+rope", lambda *a, r=rope, n=pos + 1: decode_attention(
                    *a, n, splits=1, rope=r)))
            if attn_triton.available():
                runs += [(f"triton-s{sp}+rope", lambda *a, sp=sp, r=rope:
                          attn_triton.decode_attention_triton(*a, splits=sp, cs=r.cs, qw=r.qw,
                                                              kw=r.kw, eps=r.eps))
                         for sp in (0, 1)]
        _time_attention_runs("decode_attention_rows", bs, pos, runs, args, kv_bytes)
        del args  # the caches (~GBs at 256 rows) before the next case's
    if attn_triton.available():
        bench_attention_shared_prefix()


def bench_attention_shared_prefix() -> None:
    """The slow AR's decode attention with every row's first 4 blocks (256 positions: a
    10 s voice's prompt) shared, as sessions speaking with one stored voice have them: csrc's
    kernel and the Triton kernel reading every row's positions against the Triton kernel
    with the shared prefix read once per 16-row tile (`prefix`), graph-timed; GB/s over the
    keys and values the rows attend to (the prefix counted per row)."""
    from engine.shared_prefix import SharedPrefixes

    dt, BS = torch.bfloat16, 64
    for bs, pos in ((64, 600), (128, 600), (256, 400), (256, 600)):
        args = _slow_attention_case(bs, pos, shared=4)
        table = args[5]
        kv_bytes = 2 * bs * (pos + 1) * 8 * 128 * dt.itemsize
        sp = SharedPrefixes(bs, BS, attn_triton.prefix_rows_per_tile(32, 8), "cuda")
        for r, blocks in enumerate(table.tolist()):
            sp.set(r, blocks)
        sp.refresh()
        runs: list[tuple[str, Callable[..., object]]] = []
        if extension_available():
            runs.append(("csrc", lambda *a, n=pos + 1: decode_attention(*a, n, splits=1)))
        runs += [("triton", attn_triton.decode_attention_triton),
                 ("triton+prefix", lambda *a, t=sp.tiles: attn_triton.decode_attention_triton(
                     *a, prefix=t)),
                 ("triton+prefix:w4", lambda *a, t=sp.tiles:
                  attn_triton.decode_attention_triton(*a, prefix=t, prefix_warps=4))]
        _time_attention_runs("decode_attention_shared", bs, pos, runs, args, kv_bytes)
        del args  # the caches (~GBs at 256 rows) before the next case's


def bench_step_book(dev: str, kind: str, cuda: bool) -> None:
    """The decode step's bookkeeping: csrc's one launch each against the compiled functions
    (inductor: one kernel per output size) and the torch ones, at the S2-Pro step's shapes."""
    ref = Bookkeeping()
    book = Bookkeeping.built(fusion.compiled) if cuda else None
    dt = torch.bfloat16 if cuda else torch.float32
    for bs in (1, 64):
        f32 = [torch.rand(bs, device=dev) for _ in range(4)]
        i64 = [torch.randint(1, 30, (bs,), device=dev) for _ in range(3)]
        cases = {
            "ras_inputs": (step_book.ras_inputs, (torch.randn(bs, 4097, device=dev).to(dt),
                                                  *f32, *i64)),
            "frame_tokens": (step_book.frame_tokens, (
                torch.randint(0, 4097, (bs,), device=dev), 4096, 151678, 151645,
                torch.randn(4096, 2560, device=dev).to(dt),
                torch.randn(bs, 2560, device=dev).to(dt))),
            "step_end": (step_book.step_end, (
                [torch.randint(0, 4096, (bs,), device=dev) for _ in range(11)],
                torch.ones(bs, dtype=torch.bool, device=dev),
                torch.zeros(bs, 11, dtype=torch.int64, device=dev),
                torch.zeros(bs, dtype=torch.int64, device=dev),
                torch.full((bs,), 10**9, dtype=torch.int64, device=dev),
                torch.ones(bs, dtype=torch.bool, device=dev),
                torch.zeros(bs, dtype=torch.int64, device=dev), 151645)),
        }
        for fn_name, (fn, args) in cases.items():
            runs = [(kind, fn), ("torch", getattr(ref, fn_name))]
            if book is not None:
                runs.append(("compiled", getattr(book, fn_name)))
            for name, f in runs:
                with torch.inference_mode():
                    us = timed(f, args, 500 if cuda else 50, cuda)
                print(f"{fn_name} bs={bs:4d} {name:8s} {us:8.2f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench_latency.kernel_bench",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention-rows", action="store_true",
                    help="also time the slow AR's decode attention at 1-256 rows, csrc's "
                         "against the Triton tile kernel, graph-timed (CUDA; ~60 s)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    kind = "kernel" if cuda and extension_available() else "wrapper"
    for bs in (1, 64, 128):
        prev = torch.randint(0, 4096, (bs, 16, 10), dtype=torch.int32, device=dev)
        nxt = torch.randint(0, 4096, (bs, 10), dtype=torch.int32, device=dev)
        for name, fn in ((kind, prev_tokens_shift_inplace), ("torch", prev_tokens_shift_torch)):
            us = timed(fn, (prev, nxt), 1000, cuda)
            print(f"prev_tokens_shift bs={bs:4d} {name:7s} {us:8.2f} us")
    bench_step_book(dev, kind, cuda)
    dt = torch.bfloat16 if cuda else torch.float32
    for bs, pos in ((1, 200), (1, 1000), (64, 200), (64, 1000)):
        S, BS = 1024, 64  # the engine's KV pool: blocks of 64 positions, rows' blocks shuffled
        mb = S // BS
        q = torch.randn(bs, 32, 128, device=dev, dtype=dt)
        kn, vn = (torch.randn(bs, 8, 128, device=dev, dtype=dt) for _ in range(2))
        kc, vc = (torch.randn(bs * mb + 1, 8, BS, 128, device=dev, dtype=dt) for _ in range(2))
        table = torch.randperm(bs * mb, device=dev).view(bs, mb)
        ps = torch.full((bs,), pos, device=dev)
        ws = table[:, pos // BS].contiguous()
        for name, fn in ((kind, lambda *a: decode_attention(*a, splits=1)),
                         (f"{kind}-split", lambda *a: decode_attention(*a, splits=0)),
                         ("torch", decode_attention_torch)):
            us = timed(fn, (q, kn, vn, kc, vc, table, ws, ps, pos + 1), 200 if cuda else 5, cuda)
            print(f"decode_attention bs={bs:3d} pos={pos:5d} {name:12s} {us:9.2f} us")
    if cuda and args.attention_rows:
        bench_attention_many_rows()
    for bs in (1, 64, 128):  # a main-token draw: 4,096 semantic tokens + <|im_end|>
        logits = 3 * torch.randn(bs, 4097, device=dev)
        args = (logits, torch.full((bs,), 0.8, device=dev), torch.full((bs,), 0.8, device=dev),
                torch.full((bs,), 30, device=dev), torch.arange(bs, device=dev),
                torch.zeros(bs, dtype=torch.int64, device=dev),
                torch.ones(bs, dtype=torch.int64, device=dev))
        for name, fn in ((kind, sample_topk), ("torch", sample)):
            us = timed(fn, args, 200 if cuda else 20, cuda)
            print(f"sample_topk bs={bs:4d} {name:7s} {us:9.2f} us")
    # a fast-AR draw with its next input row (2,560 bf16 values) against the draw + a lookup
    fast = torch.randn(4096, 2560, device=dev).to(dt)
    for bs in (1, 64):
        logits = 3 * torch.randn(bs, 4096, device=dev)
        args = (logits, torch.full((bs,), 0.8, device=dev), torch.full((bs,), 0.8, device=dev),
                torch.full((bs,), 30, device=dev), torch.arange(bs, device=dev),
                torch.zeros(bs, dtype=torch.int64, device=dev),
                torch.ones(bs, dtype=torch.int64, device=dev), fast)
        def two_launches(*a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids = sample_topk(*a[:-1])
            return ids, torch.nn.functional.embedding(ids, a[-1])

        for name, fn in ((kind, sample_topk_embed), ("draw+lookup", two_launches)):
            us = timed(fn, args, 200 if cuda else 20, cuda)
            print(f"sample_topk_embed bs={bs:4d} {name:11s} {us:9.2f} us")
    # q/k norm + RoPE at the slow AR's decode and prefill shapes (q and k: slices of qkv)
    compiled = fusion.compiled("norm_rope_qk", functional.norm_rope_qk) if cuda else None
    for bs, T in ((1, 1), (64, 1), (16, 64)):
        qkv = torch.randn(bs, T, 48 * 128, device=dev, dtype=dt)
        q, k = qkv[..., :4096].view(bs, T, 32, 128), qkv[..., 4096:5120].view(bs, T, 8, 128)
        w = torch.ones(128, device=dev, dtype=dt)
        cs = functional.rope_table(T + 8, 128, 1e6).to(dev)[None, :T].expand(bs, -1, -1, -1)
        runs = [("triton" if cuda else "wrapper", norm_rope_qk),
                ("torch", lambda *a: norm_rope_qk(*a, kernel=False))]
        if compiled is not None:
            runs.append(("compiled", compiled))
        for name, fn in runs:
            us = timed(fn, (q, k, w, w, cs, 1e-6), 200 if cuda else 5, cuda)
            print(f"norm_rope_qk bs={bs:3d} T={T:3d} {name:8s} {us:9.2f} us")
    # the codec's pointwise ops at its 64 x 8 tick's shapes, channels-first and channels-last
    # (stored [B, T, C]: the CUDA codec's layout); GB/s over the bytes read and written once
    for layout in ("channels-first", "channels-last"):
        for C, T in ((96, 16384), (192, 8192), (768, 256)):
            B = 64 if cuda else 2
            x = torch.randn(B, C, T, device=dev, dtype=dt)
            if layout == "channels-last":
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            alpha = torch.rand(C, device=dev, dtype=dt) + 0.5
            tag = f"{layout} C={C:4d} T={T:5d}"
            for name, fn in ((kind, snake), ("torch", snake_torch)):
                us = timed(fn, (x, alpha), 100 if cuda else 3, cuda)
                gbs = 2 * x.numel() * x.element_size() / us / 1e3
                print(f"snake {tag} {name:7s} {us:9.2f} us {gbs:7.1f} GB/s")
            for P in (1, 54):  # a streaming conv's input [tail | snake(x)]: transposed / dilated
                tail = torch.randn(B, C, P, device=dev, dtype=dt)  # saved tails: channels-first
                for name, fn in ((kind, snake_cat), ("torch", snake_cat_torch)):
                    us = timed(fn, (tail, x, alpha), 100 if cuda else 3, cuda)
                    gbs = 2 * (x.numel() + tail.numel()) * x.element_size() / us / 1e3
                    print(f"snake_cat {tag} P={P:2d} {name:7s} {us:9.2f} us {gbs:7.1f} GB/s")
            y, bias = torch.empty_like(x).normal_(), torch.randn(C, device=dev, dtype=dt)
            for name, fn in ((kind, bias_residual), ("torch", bias_residual_torch)):
                us = timed(fn, (x, y, bias), 100 if cuda else 3, cuda)
                gbs = 3 * x.numel() * x.element_size() / us / 1e3
                print(f"bias_residual {tag} {name:7s} {us:9.2f} us {gbs:7.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
