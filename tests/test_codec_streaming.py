"""Streaming decoder: any chunking equals the offline decode; batching; stream management; errors."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from _paths import require_fixtures

from engine.codec import (
    STREAM_ATOL,
    Codec,
    CodecConfig,
    StreamingDecoder,
    dummy_codec,
    load_codec,
)
from engine.codec.layers import MAX_PASS_FRAMES, ring_size
from engine.codec.reference_checks import deterministic


def _codes(frames: int, seed: int, overflow: bool = False) -> torch.Tensor:
    """[10, frames]; with ``overflow`` residual rows go up to 4095 (as the LLM may emit)."""
    g = torch.Generator().manual_seed(seed)
    sem = torch.randint(0, 4096, (1, frames), generator=g)
    res = torch.randint(0, 4096 if overflow else 1024, (9, frames), generator=g)
    return torch.cat([sem, res])


@pytest.fixture(scope="module", params=["dummy", "fixture"])
def codec(request: pytest.FixtureRequest) -> Codec:
    if request.param == "fixture":
        return load_codec(require_fixtures())
    return dummy_codec(CodecConfig.preset("tiny"), seed=0)


def _offline(codec: Codec, codes: torch.Tensor) -> torch.Tensor:
    return codec.decode(codes[None])[0, 0].float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.mark.parametrize("buckets", [False, True])
def test_random_chunkings_match_offline(codec: Codec, buckets: bool) -> None:
    rng = random.Random(1234)
    with deterministic():
        for trial in range(4):
            frames = rng.randint(5, 24)
            codes = _codes(frames, seed=trial, overflow=trial % 2 == 1)
            want = _offline(codec, codes)
            dec = StreamingDecoder(codec, max_streams=2, buckets=buckets, max_frames=64)
            sid = dec.open()
            parts, i = [], 0
            while i < frames:
                n = rng.choice([0, 1, 1, 2, 3, 5, 8, 19])  # 19: over the largest frame bucket
                out = dec.decode({sid: codes[:, i : i + n]})[sid]
                assert out.dtype == torch.float32 and out.shape == (min(n, frames - i) * 2048,)
                parts.append(out)
                i += n
            assert dec.position(sid) == frames
            diff = _max_diff(torch.cat(parts), want)
            assert diff <= STREAM_ATOL, f"trial {trial}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("buckets", [False, True])
def test_streams_wrap_the_attention_ring_with_padded_passes(buckets: bool) -> None:
    """A post-module window of 17 frames makes the K/V ring exactly window - 1 + 16 = 32
    slots (no rounding slack): three streams batched at different offsets, with chunks of 1
    to 16 frames and longer (split into passes), so every pass pads the shorter streams and
    the rings wrap several times over 80 frames, match their offline decodes."""
    import dataclasses

    base = CodecConfig.preset("tiny")
    post = dataclasses.replace(base.quantizer.post_module, window_size=17)
    cfg = dataclasses.replace(base, quantizer=dataclasses.replace(base.quantizer,
                                                                  post_module=post))
    assert ring_size(17) == 32 == 17 - 1 + MAX_PASS_FRAMES
    codec = dummy_codec(cfg, seed=3)
    rng = random.Random(5)
    frames = {"a": 80, "b": 77, "c": 64}
    codes = {k: _codes(n, seed=50 + i) for i, (k, n) in enumerate(frames.items())}
    with deterministic():
        want = {k: _offline(codec, c) for k, c in codes.items()}
        dec = StreamingDecoder(codec, max_streams=3, buckets=buckets, max_frames=128)
        sids = {k: dec.open() for k in frames}
        pos, parts = dict.fromkeys(frames, 0), {k: [] for k in frames}
        while any(pos[k] < frames[k] for k in frames):
            call = {}
            for k, sid in sids.items():
                n = rng.choice([0, 1, 2, 3, 7, 13, 16, 16, 21])
                call[sid] = codes[k][:, pos[k]: pos[k] + n]
                pos[k] += call[sid].shape[-1]
            out = dec.decode(call)
            for k, sid in sids.items():
                parts[k].append(out[sid])
    for k in frames:
        diff = _max_diff(torch.cat(parts[k]), want[k])
        assert diff <= STREAM_ATOL, f"stream {k}: max abs diff {diff:.2e}"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("buckets", [False, True])
def test_compiled_transformer_ops_stream_as_offline(codec: Codec, buckets: bool,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """build_ops' compiled codec ops (inductor; its CPU backend here) for the window
    transformer's norms, RoPE, silu * mul, LayerScale'd adds and ring mask, the convs' tail
    cuts and the quantizer's projected-codebook lookup: two streams in uneven chunks match
    the offline decode, with no op falling back to its eager version."""
    import dataclasses
    import logging

    from engine.ops import build_ops

    ops = build_ops("cpu", fused="compile").codec
    calls: dict[str, int] = {}

    def counted(name: str):  # type: ignore[no-untyped-def]
        fn = getattr(ops, name)
        assert fn.__name__ == f"compiled_codec_{name}"

        def call(*a):  # type: ignore[no-untyped-def]
            calls[name] = calls.get(name, 0) + 1
            return fn(*a)
        return call

    names = ("rms_norm", "norm_rope_qk", "silu_mul", "add_scaled", "ring_window", "take_last",
             "lookup_sum")
    ops = dataclasses.replace(ops, **{n: counted(n) for n in names})
    codes = [_codes(n, seed=60 + n) for n in (21, 13)]
    with deterministic(), caplog.at_level(logging.ERROR, logger="engine.fusion"):
        want = [_offline(codec, c) for c in codes]
        dec = StreamingDecoder(codec, max_streams=2, buckets=buckets, max_frames=64, ops=ops)
        sids = [dec.open(), dec.open()]
        parts: list[list[torch.Tensor]] = [[], []]
        at = [0, 0]
        for n in (1, 5, 2, 8, 7):
            out = dec.decode({sid: codes[i][:, at[i]: at[i] + n] for i, sid in enumerate(sids)})
            for i, sid in enumerate(sids):
                parts[i].append(out[sid])
                at[i] += n
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    assert set(calls) == set(names)  # the streaming path runs each of them
    for i in range(2):
        diff = _max_diff(torch.cat(parts[i]), want[i])
        assert diff <= STREAM_ATOL, f"stream {i}: max abs diff {diff:.2e}"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_warm_compiles_every_bucket_specialisation() -> None:
    """After `StreamingDecoder.warm` (the engine's start-up, with compiled ops), a pass in
    any (streams, frames) bucket compiles nothing: without it the first pass of two
    streams compiles the ops again (a size of 1 is a constant to torch.compile), which the
    engine would do in a background capture while it serves."""
    from torch._dynamo.utils import counters

    from engine.ops import build_ops

    codec = dummy_codec(CodecConfig.preset("tiny"), seed=1)
    ops = build_ops("cpu", fused="compile").codec
    # fresh compiled ops (own caches): what other tests compiled does not count
    dec = StreamingDecoder(codec, max_streams=4, buckets=True, max_frames=32, ops=ops)
    assert dec.warm_keys() == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert dec.warm() > 0
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for key in dec.bucket_keys():
            dec._static_pass(dec._inputs(*key))
    assert counters["stats"]["unique_graphs"] == before, "a bucket compiled after warm()"
    # the scratch row only: no stream's state was touched
    assert not dec._flat[:-1].any() and not dec._ring_flat[:-1].any()
    one = StreamingDecoder(codec, max_streams=1, buckets=True, max_frames=32, ops=ops)
    assert one.warm_keys() == [(1, 1), (1, 2)]


def test_projected_codebook_lookup_streams_as_offline(codec: Codec) -> None:
    """CodecOps.lookup_sum (the latent from each codebook's out_proj'd rows, summed in the
    decode's order) streams as the offline decode; the projected tables are kept until a
    weight changes in place, then remade."""
    import functools

    from engine.codec.layers import CodecOps
    from engine.codec.quantizer import lookup_sum

    q = codec.quantizer.quantizer.quantizers[0]
    codes = _codes(9, seed=70)
    with deterministic():
        want = _offline(codec, codes)
        dec = StreamingDecoder(codec, max_streams=1, ops=CodecOps(lookup_sum=lookup_sum))
        sid = dec.open()
        got = torch.cat([dec.decode({sid: codes[:, a:b]})[sid] for a, b in ((0, 2), (2, 9))])
        direct = q.lookup(torch.arange(5)[None])[0].t()  # [5, D]
    assert _max_diff(got, want) <= STREAM_ATOL
    table = q.table()
    assert q.table() is table  # kept
    torch.testing.assert_close(table[:5], direct, rtol=1e-6, atol=1e-6)
    saved = q.out_proj.bias.detach().clone()
    try:
        with torch.no_grad():
            q.out_proj.bias.add_(1.0)
        assert q.table() is not table
        torch.testing.assert_close(q.table(), table + 1.0, rtol=1e-5, atol=1e-5)
    finally:
        with torch.no_grad():
            q.out_proj.bias.copy_(saved)
    assert CodecOps().lookup_sum is None  # the default keeps the modules' own lookups
    # a replaced weight (another parameter object) remakes the table too
    q.out_proj.bias = torch.nn.Parameter(saved + 2.0, requires_grad=False)
    torch.testing.assert_close(q.table(), table + 2.0, rtol=1e-5, atol=1e-5)
    q.out_proj.bias = torch.nn.Parameter(saved, requires_grad=False)
    # the sums in the decode's order, bit for bit (bf16 rounds after every add)
    tables = [t.to(torch.bfloat16) for t in codec.quantizer.tables()]
    c = codes[None].clone()
    c[:, 1:] = c[:, 1:].clamp(max=tables[1].shape[0] - 1)
    r = functools.reduce(lambda acc, i: acc + tables[i][c[0, i]], range(1, len(tables)),
                         torch.zeros((), dtype=torch.bfloat16))
    want_z = (tables[0][c[0, 0]] + r).t()
    assert torch.equal(lookup_sum(c, tables)[0], want_z)


def _not_called(*args: object) -> torch.Tensor:
    raise AssertionError("the packed FFN's w1 / w3 module was called")


def test_packed_transformer_ffn_streams_as_offline() -> None:
    """fusion.pack_ffn on a codec and CodecOps.packed_ffn (as the engine does with compiled
    ops): the streamed window transformer runs each FFN's W1 | W3 as one GEMM (its w1 / w3
    modules are not called) and streams as the offline decode, which reads the same values
    through the modules; without the flag a packed codec streams through the modules."""
    from engine.codec.layers import CodecOps, FeedForward
    from engine.fusion import pack_ffn

    codec = dummy_codec(CodecConfig.preset("tiny"), seed=4)
    assert pack_ffn(codec) > 0
    for ff in codec.quantizer.post_module.modules():
        if isinstance(ff, FeedForward):
            for lin in (ff.w1, ff.w3):
                lin.forward = _not_called  # type: ignore[method-assign]
    codes = _codes(11, seed=80)
    with deterministic():
        dec = StreamingDecoder(codec, max_streams=1, ops=CodecOps(packed_ffn=True))
        sid = dec.open()
        got = torch.cat([dec.decode({sid: codes[:, a:b]})[sid] for a, b in ((0, 3), (3, 11))])
    for ff in codec.quantizer.post_module.modules():  # the offline decode calls the modules
        if isinstance(ff, FeedForward):
            del ff.w1.forward, ff.w3.forward
    with deterministic():  # and so do the streaming layers without the flag
        plain = StreamingDecoder(codec, max_streams=1)
        sid = plain.open()
        unflagged = plain.decode({sid: codes})[sid]
    with deterministic():
        want = _offline(codec, codes)
    assert _max_diff(got, want) <= STREAM_ATOL
    assert _max_diff(unflagged, want) <= STREAM_ATOL


def test_one_frame_chunks_past_the_window(codec: Codec) -> None:
    # 1-frame chunks over more frames than the attention window (4) and conv receptive fields
    codes = _codes(12, seed=7)
    with deterministic():
        want = _offline(codec, codes)
        dec = StreamingDecoder(codec, max_streams=1)
        sid = dec.open()
        got = torch.cat([dec.decode({sid: codes[:, i : i + 1]})[sid] for i in range(12)])
    assert _max_diff(got, want) <= STREAM_ATOL


@pytest.mark.parametrize(("buckets", "graph_streams", "call_frames"),
                         [(False, None, 0), (False, None, 8), (True, None, 0), (True, 2, 0)])
def test_three_streams_batched_at_different_offsets(codec: Codec, buckets: bool,
                                                    graph_streams: int | None,
                                                    call_frames: int) -> None:
    """graph_streams=2: three streams decode as two bucketed groups (2 + 1) in one call;
    call_frames=8: unbucketed passes of at most 8 streams x padded frames."""
    lengths = {"a": 17, "b": 11, "c": 14}
    codes = {
        k: _codes(n, seed=i + 20, overflow=k == "c") for i, (k, n) in enumerate(lengths.items())
    }
    sizes = {"a": [1], "b": [3, 2], "c": [7, 1, 4]}
    with deterministic():
        want = {k: _offline(codec, c) for k, c in codes.items()}
        dec = StreamingDecoder(codec, max_streams=4, buckets=buckets, graph_streams=graph_streams,
                               call_frames=call_frames)
        sids, pos, parts, step = {}, dict.fromkeys(lengths, 0), {k: [] for k in lengths}, 0
        sids["a"] = dec.open()
        while any(pos[k] < lengths[k] for k in lengths):
            if step == 2:
                sids["b"] = dec.open()  # joins late: other streams are mid-sequence
            if step == 4:
                sids["c"] = dec.open()
            call = {}
            for k, sid in sids.items():
                n = sizes[k][step % len(sizes[k])]
                if k == "b" and step == 5:
                    n = 0  # a stream with nothing new this tick rides along
                call[sid] = codes[k][:, pos[k] : pos[k] + n]
                pos[k] += call[sid].shape[-1]
            out = dec.decode(call)
            assert set(out) == set(call)
            for k, sid in sids.items():
                parts[k].append(out[sid])
            step += 1
    for k in lengths:
        diff = _max_diff(torch.cat(parts[k]), want[k])
        assert diff <= STREAM_ATOL, f"stream {k}: max abs diff {diff:.2e}"


def test_passes_are_bounded_and_a_bad_stream_changes_no_state() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"), seed=0)
    dec = StreamingDecoder(codec, max_streams=4, call_frames=6)
    items = [(0, 0, _codes(n, 0)) for n in (2, 2, 3, 7, 1)]
    groups = dec._groups(items)
    assert [[it[2].shape[-1] for it in g] for g in groups] == [[2, 2], [3], [7], [1]]
    assert all(len(g) * max(it[2].shape[-1] for it in g) <= 6 or len(g) == 1 for g in groups)
    a, b = dec.open(), dec.open()
    bad = _codes(4, 1)
    bad[0, 2] = -1
    with pytest.raises(ValueError, match="negative"):
        dec.decode({a: _codes(5, 2), b: bad})  # b would be decoded in a later pass than a
    assert dec.position(a) == 0 and dec.position(b) == 0


def test_bucketed_limits_and_errors(codec: Codec) -> None:
    """Bucketed passes pad to (streams, frames) buckets with a scratch state row; a stream
    may not run past max_frames (the RoPE rows were sized for it); bad codes are named."""
    dec = StreamingDecoder(codec, max_streams=3, buckets=True, max_frames=10)
    assert dec.stream_buckets == [1, 2, 3]
    a, b = dec.open(), dec.open()
    dec.decode({a: _codes(6, seed=1), b: _codes(2, seed=2)})
    with pytest.raises(ValueError, match="max_frames=10"):
        dec.decode({a: _codes(5, seed=3)})
    bad = _codes(2, seed=4)
    bad[3, 1] = -1
    with pytest.raises(ValueError, match=f"codes for stream {b} contain negative values"):
        dec.decode({b: bad})
    assert dec.position(a) == 6 and dec.position(b) == 2  # failed calls changed nothing
    # more streams than the largest bucket: groups, checked as a whole before the first pass
    grouped = StreamingDecoder(codec, max_streams=3, buckets=True, max_frames=10, graph_streams=1)
    assert grouped.stream_buckets == [1]
    x, y = grouped.open(), grouped.open()
    with pytest.raises(ValueError, match=f"codes for stream {y} contain negative values"):
        grouped.decode({x: _codes(2, seed=5), y: bad})
    with pytest.raises(ValueError, match="max_frames=10"):
        grouped.decode({x: _codes(2, seed=5), y: _codes(11, seed=6)})
    assert grouped.position(x) == 0 and grouped.position(y) == 0
    for g in (0, 4, 2.0, True):
        with pytest.raises(ValueError, match="graph_streams"):
            StreamingDecoder(codec, max_streams=3, buckets=True, graph_streams=g)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="CUDA"):
        dec.capture()


def test_cudnn_autotuner_only_around_big_buckets(codec: Codec) -> None:
    """cuDNN's autotuner (process-wide flags) is on, with at most AUTOTUNE_LIMIT algorithms
    per shape, only while a bucket of AUTOTUNE_MIN_WORK stream-frames or more is warmed, and
    both flags are restored afterwards, also when the pass fails."""
    cudnn = torch.backends.cudnn
    dec = StreamingDecoder(codec, max_streams=2, buckets=True, max_frames=10)
    before = (cudnn.benchmark, cudnn.benchmark_limit)
    try:
        cudnn.benchmark, cudnn.benchmark_limit = False, 10
        work = dec.AUTOTUNE_MIN_WORK
        for streams, frames in ((1, work - 1), (work // 2 - 1, 2)):  # below: heuristic plans
            with dec._cudnn_plans(streams, frames):
                assert (cudnn.benchmark, cudnn.benchmark_limit) == (False, 10)
        with pytest.raises(KeyError), dec._cudnn_plans(work // 2, 2):
            assert (cudnn.benchmark, cudnn.benchmark_limit) == (True, dec.AUTOTUNE_LIMIT)
            raise KeyError("a failing warm-up")
        assert (cudnn.benchmark, cudnn.benchmark_limit) == (False, 10)
        cudnn.benchmark = True  # a user's own autotuning is left as it was
        with dec._cudnn_plans(1, 1):
            assert (cudnn.benchmark, cudnn.benchmark_limit) == (True, 10)
    finally:
        cudnn.benchmark, cudnn.benchmark_limit = before


def test_reset_and_close(codec: Codec) -> None:
    codes = _codes(6, seed=3)
    with deterministic():
        dec = StreamingDecoder(codec, max_streams=2)
        a = dec.open()
        first = dec.decode({a: codes})[a]
        dec.decode({a: _codes(5, seed=99)})  # history the reset must forget
        dec.reset(a)
        assert dec.position(a) == 0
        again = dec.decode({a: codes})[a]
        assert _max_diff(again, first) <= STREAM_ATOL
        b = dec.open()
        with pytest.raises(RuntimeError, match="all 2 streams are open"):
            dec.open()
        dec.close(a)
        assert dec.n_open == 1
        with pytest.raises(KeyError, match="unknown or closed stream id"):
            dec.decode({a: codes})
        c = dec.open()  # reuses a's slot, with clean state
        assert c not in (a, b)
        fresh = dec.decode({c: codes})[c]
        assert _max_diff(fresh, first) <= STREAM_ATOL
        with pytest.raises(KeyError):
            dec.close(a)
        with pytest.raises(KeyError):
            dec.reset(12345)


def test_zero_frame_calls() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"))
    dec = StreamingDecoder(codec, max_streams=2)
    sid = dec.open()
    out = dec.decode({sid: torch.zeros(10, 0, dtype=torch.long)})
    assert out[sid].shape == (0,) and dec.position(sid) == 0
    assert dec.decode({}) == {}


def test_bad_inputs() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"))
    dec = StreamingDecoder(codec, max_streams=2)
    sid = dec.open()
    good = _codes(2, seed=0)
    with pytest.raises(ValueError, match=r"stream 0 must have shape \[10, T\]"):
        dec.decode({sid: good[:9]})
    with pytest.raises(ValueError, match=r"\[10, T\]"):
        dec.decode({sid: good[None]})
    with pytest.raises(TypeError, match="integer dtype"):
        dec.decode({sid: good.float()})
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        dec.decode({sid: good.tolist()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="stream 0 contain negative"):
        dec.decode({sid: -good})
    with pytest.raises(KeyError, match="unknown or closed stream id 7"):
        dec.decode({7: good})
    with pytest.raises(TypeError, match="mapping"):
        dec.decode([good])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_streams"):
        StreamingDecoder(codec, max_streams=0)
    with pytest.raises(TypeError, match="Codec"):
        StreamingDecoder(object(), max_streams=1)  # type: ignore[arg-type]
    # a failed call leaves the stream untouched
    assert dec.position(sid) == 0
    with deterministic():
        got = dec.decode({sid: good})[sid]
        want = _offline(codec, good)
    assert _max_diff(got, want) <= STREAM_ATOL
    # int32 codes are accepted
    dec.reset(sid)
    with deterministic():
        got32 = dec.decode({sid: good.to(torch.int32)})[sid]
    assert _max_diff(got32, want) <= STREAM_ATOL


def test_rope_positions_beyond_block_size() -> None:
    # A post-module block size smaller than the sequence: the RoPE table grows (same formula
    # per position) and streaming keeps absolute positions.
    d = CodecConfig.preset("tiny")
    assert d.quantizer.post_module is not None
    d.quantizer.post_module.config.block_size = 4
    codec = dummy_codec(d, seed=5)
    codes = _codes(15, seed=11)
    with deterministic():
        want = _offline(codec, codes)
        dec = StreamingDecoder(codec, max_streams=1)
        sid = dec.open()
        got = torch.cat([dec.decode({sid: codes[:, i : i + 2]})[sid] for i in range(0, 15, 2)])
    assert _max_diff(got, want) <= STREAM_ATOL


def test_state_buffers_are_preallocated() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"))
    dec = StreamingDecoder(codec, max_streams=8)
    bufs = {**dec._state, **dec._rings}
    before = {k: v.data_ptr() for k, v in bufs.items()}
    sid = dec.open()
    dec.decode({sid: _codes(3, seed=1)})
    assert {k: v.data_ptr() for k, v in {**dec._state, **dec._rings}.items()} == before
    assert all(v.shape[0] == 8 + 1 for v in bufs.values())  # + the scratch row
    # one K/V ring per post-module layer, kept in place: window - 1 = 3 frames + a pass's
    # 16, to 16s, of [heads, head_dim] rows; the other state is gathered and scattered
    assert set(dec._rings) == {k for k in bufs if k.endswith((".k", ".v"))}
    assert not set(dec._rings) & set(dec._state)
    assert ring_size(4) == 32 and ring_size(128) == 144
    kv = [v for k, v in dec._rings.items() if k.endswith(".k")]
    assert len(kv) == 1 and kv[0].shape == (9, 32, 2, 32)
    assert dec.state_bytes == sum(v.numel() * v.element_size() for v in bufs.values())
    # each kind's views tile one buffer (one gather and one scatter per pass for the state)
    # in 64-element aligned pieces, and resetting a stream zeroes its row of every one
    align = dec.STATE_ALIGN
    for views, flat in ((dec._state, dec._flat), (dec._rings, dec._ring_flat)):
        assert sum(-(-v[0].numel() // align) * align for v in views.values()) == flat.shape[1]
        assert all(v.storage_offset() % align == 0 for v in views.values())
        assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                   for v in views.values())
    slot = dec._slot(sid)
    assert any(bool(v[slot].any()) for v in dec._state.values())
    assert all(bool(v[slot].any()) for v in dec._rings.values())
    dec.reset(sid)
    assert not any(bool(v[slot].any()) for v in bufs.values())


def test_channels_last_conv_weights_follow_the_module() -> None:
    """conv_cl's cached NHWC weight is remade when the module's weight changes dtype, storage
    or values (a stale cache would convolve with the old weight or the wrong dtype)."""
    import torch.nn.functional as F

    from engine.codec.layers import CausalConv1d, conv_cl

    torch.manual_seed(0)
    conv = CausalConv1d(4, 6, kernel_size=3, dilation=2).conv
    x = torch.randn(2, 4, 11)
    torch.testing.assert_close(conv_cl(conv, x), conv(x))
    conv.to(torch.float64)
    torch.testing.assert_close(conv_cl(conv, x.double()), conv(x.double()))
    with torch.no_grad():
        conv.weight.mul_(2)  # in place: a new version
    torch.testing.assert_close(conv_cl(conv, x.double()), conv(x.double()))
    conv.weight = torch.nn.Parameter(torch.randn_like(conv.weight))  # a new tensor
    want = F.conv1d(x.double(), conv.weight, conv.bias, dilation=2)
    torch.testing.assert_close(conv_cl(conv, x.double()), want)


@pytest.mark.parametrize("fold_bias", [False, True])
def test_channels_last_streaming_matches_offline_and_keeps_its_layout(codec: Codec,
                                                                      fold_bias: bool) -> None:
    """The CUDA engine's codec layout (CodecOps.channels_last: convs as NHWC 2-D convs,
    activations stored [B, T, C]) on the torch formulas: three streams at different offsets
    give the offline decode, and every conv sees channels-last input and makes
    channels-last output (no layout round trips)."""
    from engine.codec.layers import CodecOps

    seen: list[tuple[str, bool, bool]] = []
    conv2d, convt2d = torch.nn.functional.conv2d, torch.nn.functional.conv_transpose2d

    def wrap(fn, name):
        def call(x, *a, **k):
            y = fn(x, *a, **k)
            if x.shape[-1] > 1 and x.shape[1] > 1 and y.shape[1] > 1:
                cl = x.is_contiguous(memory_format=torch.channels_last)
                seen.append((name, cl, y.is_contiguous(memory_format=torch.channels_last)))
            return y
        return call

    codes = [_codes(f, seed=40 + f) for f in (9, 14, 6)]
    with deterministic():
        want = [_offline(codec, c) for c in codes]
        dec = StreamingDecoder(codec, max_streams=4, max_frames=64,
                               ops=CodecOps(channels_last=True, fold_bias=fold_bias))
        sids = [dec.open() for _ in codes]
        parts: list[list[torch.Tensor]] = [[] for _ in codes]
        at = [0, 0, 0]
        torch.nn.functional.conv2d = wrap(conv2d, "conv2d")
        torch.nn.functional.conv_transpose2d = wrap(convt2d, "conv_transpose2d")
        try:
            for step in (1, 3, 2, 5, 8):
                chunk = {}
                for i, (sid, c) in enumerate(zip(sids, codes)):
                    n = min(step + i, c.shape[-1] - at[i])
                    if n > 0:
                        chunk[sid] = c[:, at[i]: at[i] + n]
                        at[i] += n
                for sid, pcm in dec.decode(chunk).items():
                    parts[sids.index(sid)].append(pcm)
        finally:
            torch.nn.functional.conv2d = conv2d
            torch.nn.functional.conv_transpose2d = convt2d
    for p, w in zip(parts, want):
        got = torch.cat(p)
        assert got.shape == w.shape
        assert _max_diff(got, w) <= STREAM_ATOL
    assert seen and {name for name, _, _ in seen} == {"conv2d", "conv_transpose2d"}
    assert all(i and o for _, i, o in seen), [s for s in seen if not (s[1] and s[2])][:5]
