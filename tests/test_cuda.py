"""GPU-only checks (skipped without CUDA): graphs vs eager, no host sync in steady state,
pingpong threads vs the synchronous loop. Run on the device with `pytest -m cuda`."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import CollectingSink, build_engine
from engine.loader import load_bundle
from engine.ops import build_ops
from engine.sampler import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def gpu_bundle():
    return load_bundle("tiny", device="cuda", dtype="fp32", max_seq_len=1024)


def _run(bundle, cfg: EngineConfig, texts, frames=12):
    eng = build_engine(bundle, cfg)
    sinks = [CollectingSink() for _ in texts]
    seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
    if cfg.pingpong:
        eng.start()
    for seq, t in zip(seqs, texts):
        eng.submit(seq, t, turn_id="a", max_frames=frames)
    if cfg.pingpong:
        for s in sinks:
            assert s.done.wait(120)
        eng.shutdown()
    else:
        eng.run_until_idle()
    return [s.results[-1].codes for s in sinks], eng


TEXTS = ["Hello there.", "مرحبا بالعالم.", "你好，世界。", "こんにちは。", "Five.", "Six!"]


def _speak(eng, n: int, frames: int) -> list[CollectingSink]:
    """One greedy turn on each of n new sessions of a pingpong engine (TEXTS), to the end;
    the engine is shut down after."""
    sinks = [CollectingSink() for _ in range(n)]
    seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
    eng.start()
    for seq, t in zip(seqs, TEXTS):
        eng.submit(seq, t, turn_id="a", max_frames=frames)
    for s in sinks:
        assert s.done.wait(120)
    eng.shutdown()
    return sinks


def test_masked_gqa_attention_keeps_a_fused_kernel():
    """The prefill's masked GQA attention at S2-Pro's heads (32 query, 8 kv, head_dim 128,
    bf16) runs without SDPA's math fallback (which repeats K/V and materialises the scores)
    and matches the repeated-K/V math in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engine.model import gqa_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    N, T, S = 16, 32, 1024
    q = torch.randn(N, 32, T, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = torch.randn(2, N, 8, S, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.randint(0, S, (N, T), device="cuda", generator=g)
    mask = (torch.arange(S, device="cuda")[None, None, :] <= pos[:, :, None])[:, None]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):  # no MATH: raises if it would be needed
        got = gqa_attention(q, k, v, mask)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
        attn_mask=mask)
    assert float((got.float() - want).abs().max()) < 2e-2


def test_graphs_match_eager(gpu_bundle):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, _ = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, cuda_graphs=False,
                                             prefill_graphs=False, codec_graphs=False,
                                             pingpong=False), TEXTS)
    graphed, eng = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, cuda_graphs=True,
                                                 pingpong=False), TEXTS)
    # every batch bucket captured (one span when the attention kernel reads exactly 0..pos)
    graphs = eng.runner.step_graphs
    assert graphs and {b for b, _ in graphs} == set(eng.decode_worker.batches)
    assert len(eng.decode_worker.spans) == 1  # csrc's attention: one span serves every step
    # prefill chunks and codec ticks too
    assert len(eng.prefill_worker.graphs) and eng.codec_worker.decoder.graphs
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_pdl_launches_change_no_frame(gpu_bundle):
    """The graphed engine with csrc's kernels launched with programmatic dependent launch
    (`pdl="on"`; auto turns it on for FP8 weights) gives the greedy frames of plain
    launches."""
    on, eng = _run(gpu_bundle, EngineConfig(max_running=4, max_len=512, pingpong=False,
                                            pdl="on"), TEXTS[:4])
    assert eng.ops.pdl and eng.runner.step_graphs
    off, eng = _run(gpu_bundle, EngineConfig(max_running=4, max_len=512, pingpong=False),
                    TEXTS[:4])
    assert not eng.ops.pdl  # auto: bf16 weights launch plainly
    for a, b in zip(on, off):
        assert torch.equal(a, b)


def test_pingpong_matches_sync(gpu_bundle):
    sync, _ = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False), TEXTS)
    pp, _eng = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=True), TEXTS)
    for a, b in zip(sync, pp):
        assert torch.equal(a, b)


def test_codec_graphs_match_eager_streaming():
    """Bucketed codec passes replayed as CUDA graphs give the eager streaming decoder's audio,
    for streams joining at different times with uneven chunks (one over the largest bucket)."""
    from engine.codec import CodecConfig, dummy_codec
    from engine.codec.layers import CodecOps

    torch.backends.cudnn.allow_tf32 = False  # compare float32 with float32
    codec = dummy_codec(CodecConfig.preset("tiny"), device="cuda", dtype=torch.float32)
    kernels = build_ops("cuda").codec  # csrc's Snake (EngineConfig.codec_kernels)
    assert kernels.fold_bias, "the CUDA extension did not build"
    # graph_streams=2: from tick 2 on, three streams decode as two groups, one graph
    # replayed twice in a call (the first group's audio copied out before the second's run)
    for ops, groups in ((CodecOps(), None), (kernels, None), (kernels, 2)):
        _graphed_vs_eager(codec, ops, groups)


def _graphed_vs_eager(codec, ops, graph_streams: int | None = None) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from engine.codec import StreamingDecoder

    plain = StreamingDecoder(codec, max_streams=4, ops=ops)
    graphed = StreamingDecoder(codec, max_streams=4, buckets=True, max_frames=64,
                               graph_streams=graph_streams, ops=ops)
    graphed.capture()
    assert graphed.graphs == len(graphed.stream_buckets) * len(graphed.FRAME_BUCKETS)
    g = torch.Generator().manual_seed(5)
    codes = [torch.randint(0, 1024, (10, 40), generator=g) for _ in range(3)]
    sizes = [[2, 2, 4, 8, 19, 5], [1, 3, 7], [4]]
    ids = [(plain.open(), graphed.open()) for _ in codes]
    got: list[list[np.ndarray]] = [[] for _ in codes]
    want: list[list[np.ndarray]] = [[] for _ in codes]
    pos = [0, 0, 0]
    for tick in range(8):
        call = {}
        for i in range(min(3, 1 + tick)):  # streams join at ticks 0, 1, 2
            n = sizes[i][tick % len(sizes[i])]
            call[i] = codes[i][:, pos[i]: pos[i] + n]
            pos[i] += call[i].shape[1]
        a = plain.decode({ids[i][0]: c for i, c in call.items()})
        b = graphed.decode({ids[i][1]: c for i, c in call.items()})
        for i in call:
            want[i].append(a[ids[i][0]].cpu().numpy())
            got[i].append(b[ids[i][1]].cpu().numpy())
    for i in range(3):
        x, y = np.concatenate(got[i]), np.concatenate(want[i])
        assert x.shape == y.shape and x.size == pos[i] * 2048
        diff = float(np.abs(x - y).max())
        assert diff <= 1e-4, f"stream {i}: graphed vs eager max abs diff {diff:.3g} " \
                             f"(scale {float(np.abs(y).max()):.3g})"


def test_codec_kernels_match_torch_ops():
    """The graphed streaming codec with csrc's Snake (written into each conv's input) gives
    the offline torch codec's audio (float32), at the tiny and the S2-Pro channel widths."""
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec

    torch.backends.cudnn.allow_tf32 = False
    ops = build_ops("cuda").codec
    assert ops.fold_bias, "the CUDA extension did not build"  # conv biases folded in too
    for preset, frames in (("tiny", 24), ("s2-pro", 6)):
        codec = dummy_codec(CodecConfig.preset(preset), device="cuda", dtype=torch.float32)
        codes = torch.randint(0, 1024, (1, 10, frames), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want = codec.decode(codes.cuda())[0, 0].cpu()  # offline: the torch ops
        dec = StreamingDecoder(codec, max_streams=2, buckets=True, max_frames=64, ops=ops)
        dec.capture()
        sid = dec.open()
        with torch.inference_mode():
            got = torch.cat([dec.decode({sid: codes[0, :, a:b]})[sid].cpu()
                             for a, b in ((0, 1), (1, 4), (4, frames))])
        assert got.shape == want.shape
        diff = float((got - want).abs().max())
        assert diff <= 1e-4, f"{preset}: kernels+graphs vs torch offline max abs diff {diff:.3g}"


@pytest.mark.parametrize("codec_kernels", [False, True])
def test_engine_audio_same_with_codec_graphs(codec_kernels):
    torch.backends.cudnn.allow_tf32 = False  # compare float32 with float32
    bundle = load_bundle("tiny", device="cuda", dtype="fp32", codec_dtype="fp32", max_seq_len=1024)

    import numpy as np

    def audio(codec_graphs: bool):
        eng = build_engine(bundle, EngineConfig(max_running=4, max_len=512,
                                                   codec_graphs=codec_graphs,
                                                   codec_kernels=codec_kernels))
        assert (eng.codec_worker.decoder.graphs > 0) == codec_graphs
        assert eng.ops.codec.fold_bias is codec_kernels, "the CUDA extension did not build"
        sinks = _speak(eng, 3, 20)
        return [(s.results[-1].codes, np.concatenate(s.audio)) for s in sinks]

    # Each engine's streamed audio against the offline decode (the torch ops) of the codes it
    # generated (the two runs' codes may differ: in pingpong mode rows join the batch when
    # their prefill lands, and a float32 near-tie in a greedy draw can go either way between
    # batch sizes).
    results = (("eager", audio(False)), ("graphed", audio(True)))
    for name, runs in results:
        for i, (codes, got) in enumerate(runs):
            with torch.inference_mode():
                want = bundle.codec.decode(codes[None])[0, 0].float().cpu().numpy()  # [10, n]
            assert got.shape == want.shape, f"sequence {i} {name}: {got.shape} vs {want.shape}"
            diff = float(abs(got - want).max())
            assert diff <= 1e-4, f"sequence {i}: {name} streaming codec vs offline {diff:.3g}"


def test_sampler_kernel_engine_matches(gpu_bundle):
    """EngineConfig(sampler_kernel=True, the default) puts csrc's sample_topk inside the
    captured step; greedy frames equal the compiled torch draw's."""
    from engine.kernels import sampling

    base, eng = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False,
                                              sampler_kernel=False), TEXTS)
    assert eng.ops.sample is not sampling.sample_topk
    got, eng = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False), TEXTS)
    assert eng.ops.sample is sampling.sample_topk
    for a, b in zip(base, got):
        assert torch.equal(a, b)


def test_split_kv_engine_matches(gpu_bundle):
    """EngineConfig(split_kv=True): the captured step's decode attention splits positions
    over more blocks at this small batch; greedy frames equal the one-block kernel's."""
    base, eng = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False), TEXTS)
    assert eng.ops.decode_attention.keywords["splits"] == 1
    got, eng = _run(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False,
                                             split_kv=True), TEXTS)
    assert eng.ops.decode_attention.keywords["splits"] == 0
    for a, b in zip(base, got):
        assert torch.equal(a, b)


def test_triton_attention_engine_graphs_match_eager(monkeypatch):
    """EngineConfig(attention_triton_rows=2): the slow AR's attention runs the Triton tile
    kernel in the decode steps of two rows and more (bf16: the kernel's dtypes), and the
    captured steps give the eager steps' greedy frames."""
    from engine.kernels import decode_attention_triton

    calls = []
    real = decode_attention_triton.decode_attention_triton
    monkeypatch.setattr(decode_attention_triton, "decode_attention_triton",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    bundle = load_bundle("tiny", device="cuda", dtype="bf16", max_seq_len=1024)
    eager, eng = _run(bundle, EngineConfig(max_running=8, max_len=512, cuda_graphs=False,
                                           prefill_graphs=False, codec_graphs=False,
                                           pingpong=False, attention_triton_rows=2,
                                           decode_rope_rows=8), TEXTS)
    # the q/k norm + RoPE folded into the Triton launches at every bucket (up to 8 rows)
    assert eng.ops.describe()["attention_triton_rows"] == 2 and eng.ops.decode_rope == 8
    assert calls and min(calls) >= 2  # taken, and only from two rows
    graphed, eng = _run(bundle, EngineConfig(max_running=8, max_len=512, cuda_graphs=True,
                                             pingpong=False, attention_triton_rows=2,
                                             decode_rope_rows=8), TEXTS)
    assert eng.runner.step_graphs
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_shared_prefix_attention_engine_graphs_match_eager(monkeypatch):
    """EngineConfig(attention_shared_prefix=True) with the Triton attention from two rows:
    six sessions on one voice (the pool's shared blocks, 16 positions each) speak at once,
    the decode steps read their shared blocks through the plan's tiles, and the captured
    steps give the eager steps' greedy frames."""
    from engine.shared_prefix import SharedPrefixes

    planned = []
    real = SharedPrefixes.refresh

    def refresh(self):  # type: ignore[no-untyped-def]
        real(self)
        planned.append(self.n_tiles)

    monkeypatch.setattr(SharedPrefixes, "refresh", refresh)
    bundle = load_bundle("tiny", device="cuda", dtype="bf16", max_seq_len=1024)
    cfg = dict(max_running=8, max_len=512, pingpong=False, attention_triton_rows=2,
               attention_shared_prefix=True, kv_block_size=16)
    eager, eng = _run(bundle, EngineConfig(cuda_graphs=False, prefill_graphs=False,
                                           codec_graphs=False, **cfg), TEXTS)
    assert eng.ops.shared_prefix and eng.runner.prefixes is not None
    assert eng.stats["prefix_hits"] >= 1 and max(planned) >= 1
    graphed, eng = _run(bundle, EngineConfig(cuda_graphs=True, **cfg), TEXTS)
    assert eng.runner.step_graphs
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_steady_state_decode_has_no_host_sync(gpu_bundle):
    """Launching a decode step (graph replay, result copy to pinned memory, event record)
    never synchronises with the GPU; only reading step N-1 waits, while step N runs."""
    eng = build_engine(gpu_bundle, EngineConfig(max_running=8, max_len=512, pingpong=False))
    sinks = [CollectingSink() for _ in range(5)]
    seqs = [eng.open([], SamplingParams(seed=i), s) for i, s in enumerate(sinks)]
    for seq in seqs:
        eng.submit(seq, "Steady state.", turn_id="s", max_frames=200)
    for _ in range(40):  # prefill and join everything first
        eng.step()
        if len(eng.scheduler.running) == 5:
            break
    assert len(eng.scheduler.running) == 5
    eng.measure_gaps = False
    prev = None
    for _ in range(30):
        torch.cuda.set_sync_debug_mode("error")
        try:
            pend = eng._launch(pause=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if prev is not None:
            eng._read(prev)
        prev = pend
    eng._read(prev)
    assert all(len(s.turn.frames) >= 25 for s in seqs if s.turn is not None)


def test_fused_ops_match_reference():
    from engine import functional as model

    o = build_ops("cuda", fused="compile")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dt, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        x = torch.randn(3, 5, 256, device="cuda", generator=g).to(dt)
        y = torch.randn(3, 5, 256, device="cuda", generator=g).to(dt)
        w = (1 + 0.1 * torch.randn(256, device="cuda", generator=g)).to(dt)
        q = torch.randn(3, 5, 8, 128, device="cuda", generator=g).to(dt)
        k = torch.randn(3, 5, 2, 128, device="cuda", generator=g).to(dt)
        hw = (1 + 0.1 * torch.randn(128, device="cuda", generator=g)).to(dt)
        cs = model.rope_table(64, 128, 1e6).cuda()[torch.randint(0, 64, (3, 5), device="cuda")]
        ref = [model.rms_norm(x, w, 1e-6), *model.add_rms_norm(x, y, w, 1e-6),
               *model.norm_rope_qk(q, k, hw, hw, cs, 1e-6), *model.norm_rope_qk(q, k, None, None, cs, 1e-6),
               model.silu_mul(x, y)]
        got = [o.rms_norm(x, w, 1e-6), *o.add_rms_norm(x, y, w, 1e-6),
               *o.norm_rope_qk(q, k, hw, hw, cs, 1e-6), *o.norm_rope_qk(q, k, None, None, cs, 1e-6),
               o.silu_mul(x, y)]
        # the slow AR's input embedding: tokens inside and outside the semantic range
        tok_t = torch.randn(300, 256, device="cuda", generator=g).to(dt)
        cb_t = torch.randn(40, 256, device="cuda", generator=g).to(dt)
        cols = torch.randint(0, 10, (3, 5, 7), device="cuda", generator=g)
        cols[:, 0] = torch.randint(100, 300, (3, 7), device="cuda", generator=g)
        off = torch.arange(4, device="cuda") * 10
        emb = (cols, tok_t, cb_t, off, 120, 250, 5 ** 0.5)
        ref.append(model.embed_columns(*emb))
        got.append(o.embed_columns(*emb))
        for a, b in zip(ref, got):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (a.float() - b.float()).abs().max() <= tol


def test_fused_sampler_and_packed_ffn_match_reference():
    """The compiled draw equals the eager one (greedy always; sampled rows but for rare
    top-p boundary ties of float rounding), and the packed W1|W3 GEMM equals two GEMMs."""
    from engine import sampler
    from engine.ops import REFERENCE

    g = torch.Generator(device="cuda").manual_seed(1)
    B, V = 64, 4097
    logits = 3 * torch.randn(B, V, device="cuda", generator=g)
    temp = torch.rand(B, device="cuda", generator=g) * 1.2
    temp[:8] = 0  # greedy rows
    top_p = 0.5 + 0.5 * torch.rand(B, device="cuda", generator=g)
    top_k = torch.randint(1, 129, (B,), device="cuda", generator=g)
    seed = torch.randint(0, 2**31, (B,), device="cuda", generator=g)
    step = torch.randint(0, 500, (B,), device="cuda", generator=g)
    want = sampler.sample(logits, temp, top_p, top_k, seed, step, sampler.STREAM_MAIN)
    x = torch.randn(5, 2560, device="cuda", generator=g, dtype=torch.bfloat16)
    w13 = torch.randn(2 * 512, 2560, device="cuda", generator=g, dtype=torch.bfloat16) / 50
    ref_ffn = REFERENCE.swiglu(x, w13[:512], w13[512:])
    ops = build_ops("cuda", fused="compile", sampler_kernel=False)
    assert ops.packed_ffn and ops.sample.__name__ == "compiled_sample"
    got = ops.sample(logits, temp, top_p, top_k, seed, step, sampler.STREAM_MAIN)
    got_ffn = ops.swiglu(x, w13[:512], w13[512:])
    assert torch.equal(got[:8], want[:8])
    assert (got == want).float().mean() >= 0.95
    assert (got_ffn.float() - ref_ffn.float()).abs().max() <= 3e-2


def test_reference_fixtures_with_fused_ops_on_gpu():
    """The correctness gate for speed-ups: fused ops on the GPU still reproduce the reference
    fixtures (greedy frames exact, logits within tolerance)."""
    from _paths import require_fixtures

    from engine import verify_reference

    root = require_fixtures()
    torch.backends.cuda.matmul.allow_tf32 = False
    ops = build_ops("cuda", fused="compile")
    checks = list(verify_reference.model_checks(root, device="cuda", ops=ops))
    assert checks and all(ok for _, ok, _ in checks), [c for c in checks if not c[1]]


def test_cancel_and_close_on_the_gpu_leave_no_trace(gpu_bundle):
    """Pingpong on CUDA: a cancelled turn and a session closed mid-turn stop on the device
    (the `leave` is ordered on the decode stream), their slots are reused, and a sequence
    that takes over a slot decodes exactly as in a fresh engine."""
    import time

    def fresh():
        eng = build_engine(gpu_bundle, EngineConfig(max_running=2, max_len=512, pingpong=False))
        s = CollectingSink()
        seq = eng.open([], SamplingParams.greedy(), s)
        eng.submit(seq, "Reused slot.", turn_id="r", max_frames=10)
        eng.run_until_idle()
        return s.results[-1].codes

    want = fresh()
    eng = build_engine(gpu_bundle, EngineConfig(max_running=2, max_len=512, pingpong=True))
    eng.start()
    try:
        a, b = CollectingSink(), CollectingSink()
        sa = eng.open([], SamplingParams(seed=1), a)
        sb = eng.open([], SamplingParams(seed=2), b)
        eng.submit(sa, "A long turn to cancel.", turn_id="x", max_frames=400)
        eng.submit(sb, "A long turn to drop.", turn_id="y", max_frames=400)
        deadline = time.time() + 60
        while (len(a.audio) < 2 or len(b.audio) < 2) and time.time() < deadline:
            time.sleep(0.01)
        eng.cancel(sa)
        eng.close(sb)
        assert a.done.wait(30)
        time.sleep(0.5)
        assert not eng.runner.active.any()
        assert eng.free_rows() == 2 and eng.load()["live"] == 1  # b's blocks went back
        c = CollectingSink()
        sc = eng.open([], SamplingParams.greedy(), c)
        eng.submit(sc, "Reused slot.", turn_id="r", max_frames=10)
        assert c.done.wait(60)
        assert sc.blocks and torch.equal(c.results[-1].codes, want)
    finally:
        eng.shutdown()


def test_graph_families_captured_on_their_replay_streams(gpu_bundle, monkeypatch):
    """Decode, prefill and codec graphs are captured on the decode, prefill and codec streams
    (three distinct streams): cuBLAS's per-stream workspace is baked into a captured graph,
    and graphs replayed concurrently must not share one."""
    seen: list[torch.cuda.Stream] = []
    real = torch.cuda.CUDAGraph.capture_begin

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.cuda.current_stream())  # the stream the capture records
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", spy)
    eng = build_engine(gpu_bundle, EngineConfig(max_running=4, max_len=512,
                                                high_priority_streams=("decode", "prefill")))
    decode, prefill, codec = (eng.decode_worker.stream, eng.prefill_worker.stream,
                              eng.codec_worker.stream)
    assert len({decode, prefill, codec}) == 3 and seen
    assert set(seen) == {decode, prefill, codec}
    # the configured priorities (lower is higher)
    assert decode.priority == prefill.priority < codec.priority
    eq = build_engine(gpu_bundle, EngineConfig(max_running=2, max_len=512, cuda_graphs=False,
                                               codec_graphs=False, prefill_graphs=False))
    w = (eq.decode_worker, eq.prefill_worker, eq.codec_worker)
    assert w[0].stream.priority == w[1].stream.priority == w[2].stream.priority


def test_codec_bias_folding_bf16_matches_unfolded():
    """bf16, csrc's Snake on: the streaming decoder with the residual units' conv biases folded
    into the pointwise kernels gives the unfolded audio (same roundings: cuDNN returns the
    conv without its bias and torch adds it as a separate bf16 op, as the kernels do)."""
    import dataclasses

    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec

    codec = dummy_codec(CodecConfig.preset("s2-pro"), device="cuda", dtype=torch.bfloat16)
    codes = torch.randint(0, 1024, (10, 12), generator=torch.Generator().manual_seed(3))
    kernels = build_ops("cuda").codec
    assert kernels.fold_bias, "the CUDA extension did not build"
    out = {}
    for fold in (False, True):
        dec = StreamingDecoder(codec, max_streams=2,
                               ops=dataclasses.replace(kernels, fold_bias=fold))
        sid = dec.open()
        with torch.inference_mode():
            out[fold] = torch.cat([dec.decode({sid: codes[:, a:b]})[sid].cpu()
                                   for a, b in ((0, 2), (2, 6), (6, 12))])
    diff = float((out[True] - out[False]).abs().max())
    assert diff <= 1e-2, f"folded vs unfolded bf16 audio max abs diff {diff:.3g}"


def test_two_engines_with_different_ops_in_one_process(gpu_bundle):
    """Ops are the engine's, not the process's: an engine with every speed-up (compiled ops,
    csrc's attention, sampler and codec kernels, graphs) and one with the reference math
    and no graphs, built and run side by side over one model, each give the greedy frames
    of a fresh engine of their own kind."""
    fast_cfg = EngineConfig(max_running=4, max_len=512, pingpong=False)
    ref_cfg = EngineConfig(max_running=4, max_len=512, pingpong=False, fused_ops="reference",
                           cuda_kernels=False, cuda_graphs=False, prefill_graphs=False,
                           codec_graphs=False)
    alone_fast, _ = _run(gpu_bundle, fast_cfg, TEXTS[:4])
    alone_ref, _ = _run(gpu_bundle, ref_cfg, TEXTS[:4])
    fast, ref = build_engine(gpu_bundle, fast_cfg), build_engine(gpu_bundle, ref_cfg)
    assert fast.ops.fused == "compile" and fast.ops.decode_attention is not None
    assert ref.ops.fused == "reference" and ref.ops.decode_attention is None
    assert not ref.ops.codec.fold_bias and fast.ops.codec.fold_bias
    sinks = {eng: [CollectingSink() for _ in TEXTS[:4]] for eng in (fast, ref)}
    for eng, ss in sinks.items():
        seqs = [eng.open([], SamplingParams.greedy(), s) for s in ss]
        for seq, t in zip(seqs, TEXTS):
            eng.submit(seq, t, turn_id="a", max_frames=12)
    for _ in range(400):  # interleaved: one step of each at a time
        busy = [eng.step() for eng in (fast, ref)]
        if not any(busy):
            break
    got = {eng: [s.results[-1].codes for s in ss] for eng, ss in sinks.items()}
    for a, b, c, d in zip(got[fast], alone_fast, got[ref], alone_ref):
        assert torch.equal(a, b) and torch.equal(c, d)


def test_paged_pool_sharing_and_eviction_change_no_frame_on_the_gpu(gpu_bundle):
    """The graphed pingpong engine with csrc's paged decode attention: sessions sharing one
    voice (copy-on-write) and idle sessions evicted to host memory and restored give the
    greedy frames of sessions that each keep their own KV."""
    def run(**cfg):
        eng = build_engine(gpu_bundle, EngineConfig(max_running=2, max_len=256, **cfg))
        eng.start()
        try:
            sinks = [CollectingSink() for _ in range(4)]
            seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
            assert all(s.ready.wait(60) for s in sinks)
            for rnd in range(2):
                for i, (seq, s) in enumerate(zip(seqs, sinks)):
                    s.done.clear()
                    eng.submit(seq, f"Round {rnd}, session {i}.", turn_id=str(rnd),
                               max_frames=12)
                    assert s.done.wait(60) and not s.errors
            return [r.codes for s in sinks for r in s.results], dict(eng.stats)
        finally:
            eng.shutdown()

    want, _ = run(prefix_cache=0)
    shared, st = run(kv_block_size=16)
    evicted, ev = run(prefix_cache=0, kv_block_size=16, kv_blocks=12)
    assert st["prefix_hits"] == 3 and ev["kv_evictions"] >= 4 and ev["kv_restores"] >= 4
    for got in (shared, evicted):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_turns_prefilled_ahead_give_the_same_frames_on_the_gpu(gpu_bundle):
    """The graphed pingpong engine: turns whose heads were prefilled while their text
    streamed (prefill graphs over the heads, then the tails; the first head written into
    the shared voice prefix's last block, copy-on-write) give the greedy frames of turns
    prefilled whole, and a head the turn does not begin with is rolled back."""
    text = "Hello there, how are you doing on this fine day?"

    def run(heads):
        eng = build_engine(gpu_bundle, EngineConfig(max_running=2, max_len=512,
                                                    kv_block_size=16))
        eng.start()
        try:
            sinks = [CollectingSink() for _ in range(2)]
            seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
            assert all(s.ready.wait(60) for s in sinks)
            for rnd in range(2):
                for seq, s in zip(seqs, sinks):
                    for h in heads:
                        eng.prefill_ahead(seq, h)
                        time.sleep(0.01)  # the command reaches the scheduler
                        deadline = time.monotonic() + 30
                        while eng.scheduler.prefill_outstanding and time.monotonic() < deadline:
                            time.sleep(0.002)
                    s.done.clear()
                    eng.submit(seq, text, turn_id=str(rnd), max_frames=10)
                    assert s.done.wait(60) and not s.errors
            return [r.codes for s in sinks for r in s.results], dict(eng.stats)
        finally:
            eng.shutdown()

    want, st = run([])
    assert st["ahead_jobs"] == 0
    got, st = run(["Hello there,", "Hello there, how are you doing on"])
    assert st["ahead_hits"] == 4 and st["ahead_misses"] == 0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    missed, st = run(["Goodbye, my friend"])
    assert st["ahead_misses"] == 4
    assert all(torch.equal(g, w) for g, w in zip(missed, want, strict=True))


def test_graphs_captured_in_the_background_give_the_same_frames(gpu_bundle):
    """Fast start (ready_rows=1): the engine is built with the smallest decode bucket's graph
    (2 rows with compiled ops) and the one-row prefill and codec graphs, captures the bigger
    buckets while it serves (the decode step's on the decode thread between two steps;
    eagerly until each is in), and gives the greedy frames of an engine that captured
    everything first — for turns run during the capture and after it."""

    def two_rounds(cfg: EngineConfig, during=None):
        eng = build_engine(gpu_bundle, cfg)
        if during is not None:
            during(eng)
        sinks = [CollectingSink() for _ in TEXTS]
        seqs = [eng.open([], SamplingParams.greedy(), s) for s in sinks]
        eng.start()
        out = []
        for turn in ("a", "b"):
            for seq, t in zip(seqs, TEXTS):
                eng.submit(seq, t, turn_id=turn, max_frames=12)
            if turn == "a" and during is not None:
                assert eng.warming()  # round a runs while the background still captures
            for s in sinks:
                assert s.done.wait(120)
                s.done.clear()
            out.append([s.results[-1].codes for s in sinks])
            if turn == "a":
                assert eng.warmed(300)  # the second round runs on every graph
        eng.shutdown()
        out.append([s.pcm() for s in sinks])
        return out, eng

    def deferred(eng):
        pg, dec = eng.prefill_worker.graphs, eng.codec_worker.decoder
        dw = eng.decode_worker
        # before ready: the smallest decode bucket, one-row prefill graphs short of the whole
        # context, one-stream codec
        assert set(eng.runner.step_graphs) == {k for k in dw.keys() if k[0] == dw.batches[0]}
        assert set(pg.graphs) == {k for k in pg.keys() if k[0] == 1 and k[2] < pg.spans[-1]}
        assert dec.graphs == len(dec.FRAME_BUCKETS)
        assert eng.warming() == {
            "decode": {"captured": 0, "total": len(dw.keys()) - len(eng.runner.step_graphs)},
            "prefill": {"captured": 0, "total": len(pg.keys()) - len(pg.graphs)},
            "codec": {"captured": 0, "total": len(dec.bucket_keys()) - dec.graphs}}

    import numpy as np

    want, _ = two_rounds(EngineConfig(max_running=8, max_len=512, ready_rows=0))
    got, eng = two_rounds(EngineConfig(max_running=8, max_len=512, ready_rows=1), deferred)
    assert not eng.warming()
    assert set(eng.runner.step_graphs) == set(eng.decode_worker.keys())
    assert set(eng.prefill_worker.graphs.graphs) == set(eng.prefill_worker.graphs.keys())
    assert eng.codec_worker.decoder.graphs == len(eng.codec_worker.decoder.bucket_keys())
    for ra, rb in zip(want[:2], got[:2]):
        for a, b in zip(ra, rb):
            assert torch.equal(a, b)
    for a, b in zip(want[2], got[2]):  # the audio: codec passes of other buckets meanwhile
        # (bf16 convs of other batch sizes round differently: seen 5.4e-3 max abs)
        assert a.shape == b.shape
        assert float(np.linalg.norm(a - b) / np.linalg.norm(a)) < 0.02
        assert float(abs(a - b).max()) < 0.05


def test_fp8_engine_runs_dense_copies_where_its_table_measured_bf16_faster(tmp_path):
    """An FP8 engine whose linear table measured bf16 (csrc's kernel) faster from 2 rows on:
    build_engine gives every FP8 linear its bf16 copy (fp8_dense_copy, before the KV pool is
    sized); at 4 rows the linear, the residual epilogue and the packed SwiGLU, and at 2 rows
    the normed prologue, run csrc's kernel on the copy (bit-equal to calling it on the copy);
    turns at c=3 run through the captured graphs; with fp8_dense_copy=False no copy is made."""
    import json

    from engine.fusion import packed
    from engine.kernels import linear
    from engine.quant import Fp8Linear

    b = load_bundle("tiny", device="cuda", dtype="fp8", max_seq_len=1024)
    fp8 = [m for m in b.model.modules() if isinstance(m, Fp8Linear)]
    shapes = {tuple(m.qweight.shape) for m in fp8}
    for ff in (blk.feed_forward for blk in [*b.model.layers, *b.model.fast_layers]):
        shapes.add((2 * ff.w1.qweight.shape[0], ff.w1.qweight.shape[1]))
    rows = [{"fp8": f8, "m": m, "n": n, "k": k, "impl": "gemv", "splits": 1, "kwarps": 8,
             "variant": 0, "us": {"gemv:v0:k8:s1": t}}
            for n, k in shapes
            for f8, m, t in ((True, 1, 1.0), (False, 1, 2.0), (True, 64, 3.0), (False, 64, 2.0))]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"rows": rows}))
    off = build_engine(b, EngineConfig(max_running=4, max_len=512, fp8_dense_copy=False),
                       ops=build_ops("cuda", linear_table=table))
    assert all(m.dense_weight is None for m in fp8)
    del off
    ops = build_ops("cuda", linear_table=table)
    eng = build_engine(b, EngineConfig(max_running=4, max_len=512, pingpong=True), ops=ops)
    assert ops.fp8_dense and all(m.dense_weight is not None for m in fp8)
    kw = {"splits": 1, "kwarps": 8, "variant": 0}
    att, ff = b.model.layers[0].attention, b.model.layers[0].feed_forward
    w, wo = att.wqkv.weight, att.wo.weight
    x = torch.randn(4, w.shape[1], device="cuda").to(torch.bfloat16)
    assert torch.equal(ops.linear(x, w), linear.gemv(x, w.dense, **kw))
    y = torch.randn(4, wo.shape[1], device="cuda").to(torch.bfloat16)
    r = torch.randn(4, wo.shape[0], device="cuda").to(torch.bfloat16)
    assert torch.equal(ops.residual_kernel(y, wo, r), linear.gemv_residual(y, wo.dense, r, **kw))
    w13 = packed(ff.w1.weight, ff.w3.weight)
    assert w13.dense is not None  # W1|W3: one dense GEMM
    assert torch.equal(ops.swiglu(x, ff.w1.weight, ff.w3.weight),
                       linear.gemv_swiglu(x, w13.dense, **kw))
    nw = (1 + 0.1 * torch.randn(w.shape[1], device="cuda")).to(torch.bfloat16)
    assert torch.equal(ops.normed_kernel(x[:2], nw, 1e-6, w, False),
                       linear.gemv_normed(x[:2], nw, 1e-6, w.dense, **{k: kw[k] for k in
                                                                          ("splits", "kwarps")}))
    for s in _speak(eng, 3, 8):
        codes = s.results[-1].codes
        assert codes.shape[0] >= 1 and bool((codes >= 0).all())
