"""DualAR model, config, checkpoint loading, batched decode."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, TransformerConfig, preset
from engine.model import rope_table
from engine.runner import ModelRunner
from engine.sampler import SamplingParams
from engine.weights import CheckpointError, dummy_model, load_model, save_checkpoint

CASES = ["a_text_en", "b_ref_zh", "c_multispeaker", "d_two_turns"]


def test_s2_pro_preset_matches_published_size():
    cfg = preset("s2-pro")
    assert (cfg.slow.n_layer, cfg.slow.dim, cfg.slow.n_head, cfg.slow.n_local_heads) == (36, 2560, 32, 8)
    assert cfg.ids.semantic_start == 151678 and cfg.ids.im_end == 151645
    assert 4.4e9 < cfg.num_params() < 4.7e9  # ≈ 4.56 B


def test_checkpoint_config_reader(fixture_dir):
    cfg = ModelConfig.from_checkpoint(fixture_dir)
    assert cfg.slow.head_dim == 48 and cfg.fast.head_dim == 40 and cfg.fast.n_local_heads == 1
    assert cfg.slow.qk_norm and not cfg.fast.qk_norm
    assert cfg.ids.semantic_start == 547 and cfg.ids.semantic_end == 4642
    s2 = ModelConfig.from_checkpoint(fixture_dir.parent / "s2_pro_config.json")
    assert s2.slow == preset("s2-pro").slow


@pytest.mark.parametrize("bad", [
    {"model_type": "llama"},
    {"text_config": {"n_layer": 0}},
    {"text_config": {"attention_qkv_bias": True}},
    {"text_config": {"n_head": 3}},
])
def test_config_validation(fixture_dir, bad):
    raw = json.loads((fixture_dir / "config.json").read_text())
    for k, v in bad.items():
        if isinstance(v, dict):
            raw[k] = raw[k] | v
        else:
            raw[k] = v
    with pytest.raises(ValueError):
        ModelConfig.from_dict(raw)


def test_transformer_config_errors():
    with pytest.raises(ValueError, match="n_local_heads"):
        TransformerConfig(n_layer=1, dim=8, n_head=3, n_local_heads=2, head_dim=4,
                          intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match="head_dim"):
        TransformerConfig(n_layer=1, dim=8, n_head=2, n_local_heads=2, head_dim=3,
                          intermediate_size=8, vocab_size=8)


def test_rope_table_is_bf16_rounded():
    t = rope_table(300, 128, 1e6)
    assert t.dtype == torch.bfloat16 and t.shape == (300, 64, 2)
    exact = torch.outer(torch.arange(300.0), 1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128)))
    assert torch.allclose(t[..., 0].float(), exact.cos(), atol=4e-3)
    assert not torch.equal(t[..., 0].float(), exact.cos())


def _copy_set(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_checkpoint_errors_name_the_tensor(tmp_path, fixture_dir):
    d = _copy_set(fixture_dir, tmp_path / "ck")
    t = load_file(str(d / "model.safetensors"))
    key = "text_model.model.layers.1.attention.wqkv.weight"
    # wrong shape
    bad = dict(t)
    bad[key] = torch.zeros(10, 128, dtype=torch.bfloat16)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.attention\.wqkv.*\(10, 128\)"):
        load_model(d)
    # missing tensor
    bad = dict(t)
    del bad[key]
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors.*wqkv"):
        load_model(d)
    # unexpected tensor
    bad = dict(t)
    bad["text_model.model.layers.7.attention.wo.weight"] = torch.zeros(1)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.7"):
        load_model(d)


def test_sharded_checkpoint_roundtrip(tmp_path, fixture_model):
    save_checkpoint(fixture_model, tmp_path / "sharded", shard_bytes=2_000_000)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "audio_decoder.codebook_embeddings.weight" in index["weight_map"]
    m = load_model(tmp_path / "sharded", dtype=torch.float32)
    for (n, a), (_, b) in zip(fixture_model.state_dict().items(), m.state_dict().items()):
        assert torch.equal(a, b), n
    # a shard listed in the index but missing
    shards[0].unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        load_model(tmp_path / "sharded")


def test_bf16_load_keeps_values(fixture_dir):
    m = load_model(fixture_dir, dtype=torch.bfloat16)
    t = load_file(str(fixture_dir / "model.safetensors"))
    assert torch.equal(m.embeddings.weight, t["text_model.model.embeddings.weight"])


def _prompts(fixture_dir):
    out = []
    for name in CASES:
        t = load_file(str(fixture_dir / "cases" / f"{name}.safetensors"))
        out.append((t["b0.prompt"], t["b0.generated"]))
    return out


def test_batched_decode_matches_reference_per_sequence(fixture_dir, fixture_model):
    """Sequences with different prompt lengths, decoded together (device state only), each
    through its own blocks of 16 positions scattered over the pool, give each one's
    reference frames; a finished row stops on the device."""
    runner = ModelRunner(fixture_model, n_rows=4, max_len=512, block_size=16)
    prompts = _prompts(fixture_dir)
    budgets = [25, 25, 10, 25]
    per = 512 // 16
    shuffled = torch.randperm(runner.n_blocks, generator=torch.Generator().manual_seed(0))
    items = []
    for s, (p, _) in enumerate(prompts):  # rows 0..3, one per prompt
        items.append((tuple(shuffled[s * per: (s + 1) * per].tolist()), p[:, :-1], 0))
    # all four prompts prefilled in one padded forward, the longest split in two chunks
    runner.prefill_batch([(b, c[:, :40], 0) for b, c, _ in items])
    runner.prefill_batch([(b, c[:, 40:], 40) for b, c, _ in items if c.shape[1] > 40])
    for s, ((b, _, _), (p, _), n) in enumerate(zip(items, prompts, budgets)):
        runner.join(s, SamplingParams.greedy(), p[:, -1], p.shape[1] - 1, n, 0, b)
    outs = [runner.step(4, 200) for _ in range(25)]
    got = torch.stack(outs, dim=2)  # [B, 11+2, 25]
    for b, (_, want) in enumerate(prompts):
        n = budgets[b]
        assert torch.equal(got[b, :11, :n], want[:, :n]), CASES[b]
        assert got[b, 11, :n].all() and not got[b, 11, n:].any()  # was_active
        assert got[b, 12, n - 1] == 1  # stopped on its budget
    assert int(runner.pos[2]) == prompts[2][0].shape[1] - 1 + 10


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_ops_decode_the_reference_frames(fixture_dir, fixture_model, caplog):
    """build_ops' compiled ops (inductor; here its CPU backend: the GPU's Triton kernels come
    from the same graphs) give the reference's frames, with no op falling back to its eager
    version: the input embedding, the draws (with the next codebook's row), the norms and
    the bookkeeping whose stack and draw-step advance live in step_end."""
    import logging

    from engine.ops import build_ops

    ops = build_ops("cpu", fused="compile")
    assert ops.sample_embed.__name__ == "compiled_sample_embed"
    prompts = _prompts(fixture_dir)
    runner = ModelRunner(fixture_model, n_rows=len(prompts), max_len=512, block_size=16, ops=ops)
    with caplog.at_level(logging.ERROR, logger="engine.fusion"):
        for s, (p, _) in enumerate(prompts):
            blocks = runner.own_blocks(s)
            runner.prefill(blocks, p[:, :-1], 0)
            runner.join(s, SamplingParams.greedy(), p[:, -1], p.shape[1] - 1, 6, 0, blocks)
        got = torch.stack([runner.step(len(prompts), 200) for _ in range(6)], dim=2)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    for b, (_, want) in enumerate(prompts):
        assert torch.equal(got[b, :11], want[:, :6]), CASES[b]
    assert runner.sampling.step[: len(prompts)].tolist() == [6] * len(prompts)


def test_ras_condition_matches_reference_frames(fixture_dir, fixture_model):
    """The RAS window (last 10 main tokens of the decode loop, prefill frame excluded) flags
    exactly the frames the reference flagged."""
    runner = ModelRunner(fixture_model, n_rows=1, max_len=512)
    for name in CASES[:3]:
        case = json.loads((fixture_dir / "cases" / f"{name}.json").read_text())
        t = load_file(str(fixture_dir / "cases" / f"{name}.safetensors"))
        p = t["b0.prompt"]
        blocks = runner.own_blocks(0)  # the runner's one row, reused case after case
        runner.prefill(blocks, p[:, :-1], 0)
        runner.join(0, SamplingParams.greedy(), p[:, -1], p.shape[1] - 1, 25, 0, blocks)
        flagged = []
        for n in range(25):
            runner.step(1, 200)
            if bool(runner.sampling.last_ras_condition[0]):
                flagged.append(n)
        assert flagged == case["batches"][0]["ras_condition_frames"], name


def test_dummy_weights_deterministic_and_scaled():
    cfg = preset("tiny")
    a, b = dummy_model(cfg, seed=3), dummy_model(cfg, seed=3)
    c = dummy_model(cfg, seed=4)
    assert torch.equal(a.layers[0].attention.wqkv.weight, b.layers[0].attention.wqkv.weight)
    assert not torch.equal(a.layers[0].attention.wqkv.weight, c.layers[0].attention.wqkv.weight)
    w = a.layers[0].feed_forward.w1.weight.float()
    assert math.isclose(float(w.std()), 0.02, rel_tol=0.1)
    assert abs(float(a.norm.weight.float().mean()) - 1.0) < 0.05


def test_s2_pro_builds_on_meta():
    from engine.model import DualAR

    with torch.device("meta"):
        m = DualAR(preset("s2-pro"))
    n = sum(p.numel() for p in m.parameters())
    assert n == preset("s2-pro").num_params()


def test_bundles_load_with_their_ffns_packed():
    """load_bundle packs every SwiGLU FFN (the model's and the codec's) once, at load: an
    engine that packed them later would re-lay weights under another engine's CUDA graphs;
    build_engine's own pack is then a no-op."""
    from engine import fusion
    from engine.loader import load_bundle

    b = load_bundle("tiny")
    ffns = [m for root in (b.model, b.codec) for m in root.modules()
            if hasattr(m, "w1") and hasattr(m, "w3") and hasattr(m, "w2")]
    assert len(ffns) > b.model.cfg.slow.n_layer + b.model.cfg.fast.n_layer
    assert all(fusion.packed(f.w1.weight, f.w3.weight) is not None for f in ffns)
    assert fusion.pack_ffn(b.model) == 0 and fusion.pack_ffn(b.codec) == 0


def test_packed_ffn_keeps_the_frames(fixture_dir, fixture_model):
    """fusion.pack_ffn re-lays W1|W3 as one buffer (one GEMM per FFN input); the weights and
    the greedy frames of a fixture case (run with ops that use the packed GEMM) stay the
    same."""
    import copy

    from engine import fusion, model
    from engine.ops import REFERENCE, Ops

    m = copy.deepcopy(fixture_model)
    before = [(ff.w1.weight.clone(), ff.w3.weight.clone()) for ff in
              (mod for mod in m.modules() if isinstance(mod, model.FeedForward))]
    assert fusion.pack_ffn(m) == len(before) == m.cfg.slow.n_layer + m.cfg.fast.n_layer
    assert fusion.pack_ffn(m) == 0  # idempotent
    ffs = [mod for mod in m.modules() if isinstance(mod, model.FeedForward)]
    for ff, (w1, w3) in zip(ffs, before):
        assert torch.equal(ff.w1.weight, w1) and torch.equal(ff.w3.weight, w3)
        assert fusion.packed(ff.w1.weight, ff.w3.weight) is not None
    packed = Ops(packed_ffn=True)
    gemms: list[int] = []

    def counting_linear(x, w):  # type: ignore[no-untyped-def]
        gemms.append(w.shape[0])
        return torch.nn.functional.linear(x, w)

    x = torch.randn(3, 2, m.cfg.slow.dim)
    ff = ffs[0]
    torch.testing.assert_close(Ops(packed_ffn=True, linear=counting_linear).swiglu(
        x, ff.w1.weight, ff.w3.weight), REFERENCE.swiglu(x, ff.w1.weight, ff.w3.weight),
        rtol=1e-5, atol=1e-6)
    assert gemms == [2 * ff.w1.weight.shape[0]]  # one GEMM over both halves
    prompt, want = _prompts(fixture_dir)[0]
    runner = ModelRunner(m, n_rows=1, max_len=512, ops=packed)
    blocks = runner.own_blocks(0)
    runner.prefill(blocks, prompt[:, :-1], 0)
    runner.join(0, SamplingParams.greedy(), prompt[:, -1], prompt.shape[1] - 1, 12, 0, blocks)
    got = torch.stack([runner.step(1, 256)[0, :11] for _ in range(12)], dim=1)
    assert torch.equal(got, want[:, :12])


def test_static_prefill_matches_reference(fixture_dir, fixture_model):
    """The graph-capturable prefill (device-tensor inputs, chunks padded to a column bucket,
    keys over a span bucket) leaves the cache so that decoding gives the reference frames."""
    prompt, want = _prompts(fixture_dir)[1]
    cols = prompt[:, :-1]
    runner = ModelRunner(fixture_model, n_rows=2, max_len=512, block_size=16)
    blocks = tuple(reversed(runner.own_blocks(1)))  # out of order: reads go through the table
    at = 0
    for n, T, span in ((20, 32, 256), (cols.shape[1] - 20, 64, 256)):  # padded chunks
        inp = runner.prefill_inputs(T)
        inp["cols"][0, :, :n] = cols[:, at: at + n]
        inp["table"][0], inp["start"][0] = torch.tensor(runner.cache.table(list(blocks))), at
        runner.prefill_static(inp, span)
        at += n
    assert at == cols.shape[1]
    runner.join(0, SamplingParams.greedy(), prompt[:, -1], prompt.shape[1] - 1, 12, 0, blocks)
    got = torch.stack([runner.step(1, 256)[0, :11] for _ in range(12)], dim=1)
    assert torch.equal(got, want[:, :12])


@pytest.mark.parametrize("B, H, Hkv, T, S, mask_rows", [
    (3, 32, 8, 5, 64, 3),  # S2-Pro's 4 query heads per kv head, per-row masks (batched prefill)
    (2, 4, 1, 1, 16, 2),  # one new position (the decode step's torch path)
    (4, 6, 2, 7, 33, 1),  # one mask broadcast over the batch
    (1, 8, 8, 3, 8, 1),  # no GQA
])
def test_masked_gqa_attention_matches_repeated_kv(B, H, Hkv, T, S, mask_rows):
    """gqa_attention folds each kv head's query heads into rows (so SDPA keeps a fused kernel
    with a mask): the same attention as repeating K/V per query head."""
    from engine.model import gqa_attention

    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, H, T, 16, generator=g)
    k, v = torch.randn(2, B, Hkv, S, 16, generator=g)
    pos = torch.randint(0, S, (mask_rows, T), generator=g)
    mask = (torch.arange(S)[None, None, :] <= pos[:, :, None])[:, None]  # [rows, 1, T, S]
    rep = H // Hkv
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    got = gqa_attention(q, k, v, mask)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-5


def test_a_fused_op_raises_the_recompile_limit_in_every_thread_that_calls_it():
    """Dynamo's config is per thread from torch 2.12 on: a fused op called on an engine
    thread raises that thread's recompile limit too (with the default 8, a shape recompiled
    there past it would fall back to the reference for good)."""
    import sys
    import threading

    import torch._dynamo

    from engine import fusion

    op = fusion.compiled("double", lambda x: x * 2)
    seen: dict[str, object] = {}

    def run() -> None:
        seen["y"] = op(torch.ones(3))
        seen["limit"] = torch._dynamo.config.recompile_limit

    recursion = sys.getrecursionlimit()  # inductor raises it when it compiles: put it back
    t = threading.Thread(target=run)
    t.start()
    t.join()
    sys.setrecursionlimit(recursion)
    assert torch.equal(seen["y"], torch.full((3,), 2.0))
    assert seen["limit"] >= 64


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_a_fused_op_with_its_own_cache_keeps_its_recompiles_apart():
    """`compiled(..., own_cache=True)` (the codec's copies of the model's pointwise ops):
    dynamo keeps compiled graphs and counts recompiles per code object, so its dtypes and
    shapes land in a cache of its own, not in the one the model's wrapper of the same
    function fills; both give the function's values."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from engine import functional, fusion

    shared = fusion.compiled("add_scaled_t", functional.add_scaled)
    own = fusion.compiled("codec_add_scaled_t", functional.add_scaled, own_cache=True)
    x = torch.randn(4, 8)
    torch.testing.assert_close(shared(x, x, x[0]), functional.add_scaled(x, x, x[0]))
    after_shared = len(_debug_get_cache_entry_list(functional.add_scaled.__code__))
    assert after_shared >= 1
    for dt in (torch.float64, torch.float16):  # dtypes the shared cache has not seen
        y = x.to(dt)
        torch.testing.assert_close(own(y, y, y[0]), functional.add_scaled(y, y, y[0]))
    assert len(_debug_get_cache_entry_list(functional.add_scaled.__code__)) == after_shared


def test_fast_positions_zero_and_one_in_one_pass_decode_as_one_at_a_time(
        fixture_dir, fixture_model, monkeypatch):
    """The runner feeds the fast AR's positions 0 (the slow hidden state) and 1 (code 0's
    embedding) as one call (`forward_fast` with T = 2, causal): the same frames and fast K/V
    as one position per call, as the reference runs them."""
    case = CASES[0]
    p = load_file(str(fixture_dir / "cases" / f"{case}.safetensors"))["b0.prompt"]

    def decode() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        runner = ModelRunner(fixture_model, n_rows=2, max_len=512)
        for row, seed in ((0, 0), (1, 7)):
            blocks = runner.own_blocks(row)
            runner.prefill(blocks, p[:, :-1], 0)
            params = SamplingParams.greedy() if row == 0 else SamplingParams(seed=seed)
            runner.join(row, params, p[:, -1], p.shape[1] - 1, 8, seed, blocks)
        frames = [runner.step(2, 200).clone() for _ in range(8)]
        return frames, [t.clone() for t in (runner.fast_kv.k, runner.fast_kv.v)]

    frames, kv = decode()
    pairs: list[int] = []
    whole = fixture_model.forward_fast

    from engine.ops import REFERENCE

    def one_at_a_time(x, pos, attend, ops=REFERENCE):  # type: ignore[no-untyped-def]
        if x.shape[1] == 1:
            return whole(x, pos, attend, ops)
        pairs.append(pos)
        return torch.cat([whole(x[:, t: t + 1], pos + t, attend.at(pos + t, x.shape[0]), ops)
                          for t in range(x.shape[1])], dim=1)

    monkeypatch.setattr(fixture_model, "forward_fast", one_at_a_time)
    frames_one, kv_one = decode()
    assert pairs == [0] * 8
    assert all(torch.equal(a, b) for a, b in zip(frames, frames_one))
    for a, b in zip(kv, kv_one):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rope_rows", [0, 1, 4])
def test_decode_rope_rows_fold_the_norm_and_rope_per_batch(fixture_dir, fixture_model,
                                                           monkeypatch, rope_rows):
    """`Ops.decode_rope` = N: decode steps of at most N rows hand q/k before their norm and
    RoPE to the attention kernel (here its CPU fallback), bigger batches norm and rotate
    first; the frames are the reference's either way. FastKV offers the folded attend per
    batch the same way."""
    import dataclasses
    import functools

    from engine.cache import FastKV, PagedDecodeAttend
    from engine.kernels.decode_attention import ROPE_HEAD_DIMS, decode_attention
    from engine.ops import REFERENCE

    ops = dataclasses.replace(
        REFERENCE, decode_attention=functools.partial(decode_attention, kernel=False),
        decode_rope=rope_rows)
    fused: list[tuple[str, int]] = []
    for cls in (PagedDecodeAttend, FastKV):
        def spy(self, layer, q, *a, _raw=cls._norm_rope_attend, _name=cls.__name__):  # type: ignore[no-untyped-def]
            fused.append((_name, q.shape[0]))
            return _raw(self, layer, q, *a)
        monkeypatch.setattr(cls, "_norm_rope_attend", spy)
    # the kernel's CPU fallback stands in for csrc's (the runner takes the kernel on CUDA)
    monkeypatch.setattr(ModelRunner, "_attention_kernel", lambda self, c: self.ops.decode_attention)
    prompts = _prompts(fixture_dir)
    for B in (1, 3):
        fused.clear()
        runner = ModelRunner(fixture_model, n_rows=B, max_len=512, block_size=16, ops=ops)
        for s, (p, _) in enumerate(prompts[:B]):
            blocks = runner.own_blocks(s)
            runner.prefill(blocks, p[:, :-1], 0)
            runner.join(s, SamplingParams.greedy(), p[:, -1], p.shape[1] - 1, 6, 0, blocks)
        got = torch.stack([runner.step(B, 200) for _ in range(6)], dim=2)
        for b, (_, want) in enumerate(prompts[:B]):
            assert torch.equal(got[b, :11], want[:, :6]), (B, b)
        cfg = fixture_model.cfg
        if B <= rope_rows:  # every slow attention of the 6 steps
            assert fused.count(("PagedDecodeAttend", B)) == 6 * cfg.slow.n_layer
        # the fast AR's head_dim 40 has no fused RoPE (ROPE_HEAD_DIMS): never folded
        assert cfg.fast.head_dim not in ROPE_HEAD_DIMS
        assert fused.count(("PagedDecodeAttend", B)) == len(fused)
        if B > rope_rows:
            assert fused == []
    fast = FastKV(cfg, 4, device="cpu", dtype=torch.float32, kernel=ops.decode_attention,
                  rope_rows=rope_rows)
    for b in (1, 2, 4):
        assert (fast.at(3, b).norm_rope_attend is not None) == (b <= rope_rows)
    no_kernel = FastKV(cfg, 4, device="cpu", dtype=torch.float32, rope_rows=rope_rows)
    assert no_kernel.at(0, 1).norm_rope_attend is None


def test_fast_decode_rope_rows_are_the_fast_ars_own(fixture_model, monkeypatch):
    """The fast AR folds its q/k norm + RoPE up to `decode_rope_fast` rows, the slow AR up to
    `decode_rope`: EngineConfig's fast_decode_rope_rows defaults to decode_rope_rows and is
    kept when given; the runner hands each stack its own count."""
    import dataclasses
    import functools

    import engine.runner as runner_mod
    from engine.config import EngineConfig
    from engine.kernels.decode_attention import decode_attention
    from engine.ops import REFERENCE

    assert EngineConfig(decode_rope_rows=64).resolved(
        cuda=True, model_len=4096).fast_decode_rope_rows == 64
    assert EngineConfig(decode_rope_rows=64, fast_decode_rope_rows=2).resolved(
        cuda=True, model_len=4096).fast_decode_rope_rows == 2
    with pytest.raises(ValueError, match="fast_decode_rope_rows"):
        EngineConfig(fast_decode_rope_rows=-1)
    cfg = fixture_model.cfg
    # let the fixture's fast head size (40) take the fold, as S2-Pro's 128 does
    monkeypatch.setattr(runner_mod, "ROPE_HEAD_DIMS", (cfg.slow.head_dim, cfg.fast.head_dim))
    monkeypatch.setattr(ModelRunner, "_attention_kernel", lambda self, c: self.ops.decode_attention)
    ops = dataclasses.replace(
        REFERENCE, decode_attention=functools.partial(decode_attention, kernel=False),
        decode_rope=64, decode_rope_fast=2)
    runner = ModelRunner(fixture_model, n_rows=4, max_len=256, block_size=16, ops=ops)
    assert runner.fast_kv.rope_rows == 2
    assert runner._rope_rows(cfg.slow, ops.decode_rope) == 64
    assert ops.describe()["decode_rope_fast"] == 2


def test_runner_plans_shared_voice_prefixes_from_its_row_ops(fixture_dir, fixture_model,
                                                             monkeypatch):
    """With `Ops.shared_prefix` the runner plans which speaking rows share their leading KV
    blocks from its row ops (join, extend, leave), stages the plan at `launch` and hands it
    to the decode attention; two rows on one prompt's shared blocks (each past them in
    blocks of its own) still give the reference's frames (the kernel's CPU fallback reads
    every row's positions: the plan is the Triton kernel's, tested in
    tests/test_decode_attention_triton.py)."""
    import dataclasses
    import functools

    from engine.kernels.decode_attention import decode_attention
    from engine.ops import REFERENCE
    from engine.request import RowOp

    seen: list[object] = []

    def kernel(*a, prefix=None, **kw):  # type: ignore[no-untyped-def]
        seen.append(prefix)
        return decode_attention(*a, kernel=False, **kw)

    monkeypatch.setattr(ModelRunner, "_attention_kernel", lambda self, c: kernel)
    # the Triton kernel's rows from 2 (the plan goes to steps of that many rows and more)
    ops = dataclasses.replace(REFERENCE, decode_attention=functools.partial(
        kernel, triton_rows=2), shared_prefix=True)
    assert ops.attention_triton_rows == 2
    runner = ModelRunner(fixture_model, n_rows=4, max_len=512, block_size=16, ops=ops)
    assert runner.prefixes is not None and runner.prefixes.rows_per_tile >= 2
    p, want = _prompts(fixture_dir)[0]
    T = p.shape[1] - 1
    n = T // 16  # whole blocks of the prompt: the shared ones
    assert n >= 1
    shared = runner.own_blocks(0)[:n]
    rows = {0: runner.own_blocks(0), 1: shared + runner.own_blocks(1)[n:]}
    runner.prefill(rows[0], p[:, :-1], 0)
    runner.prefill(rows[1], p[:, n * 16: -1], n * 16)  # row 1's own part of the prompt
    for r, blocks in rows.items():
        runner.join(r, SamplingParams.greedy(), p[:, -1], T, 6, 0, blocks)
    got = torch.stack([runner.launch(2, 200) for _ in range(6)], dim=2)
    for r in rows:
        assert torch.equal(got[r, :11], want[:, :6]), r
    tiles = runner.prefixes.tiles
    assert runner.prefixes.n_tiles == 1 and tiles.length.tolist()[0] == n * 16
    assert tiles.rows.tolist()[0][:3] == [0, 1, -1]
    assert tiles.start.tolist()[:3] == [n * 16, n * 16, 0]
    slow = [s for s in seen if s is not None]  # the fast AR's calls have no prefix
    assert len(slow) == 6 * fixture_model.cfg.slow.n_layer and all(s is tiles for s in slow)
    # one row below the Triton kernel's rows: no plan handed over
    seen.clear()
    runner.launch(1, 200)
    assert [s for s in seen if s is not None] == []
    runner.leave(1)
    runner.launch(2, 200)
    assert runner.prefixes.n_tiles == 0 and tiles.start.tolist()[:2] == [0, 0]
    # a turn that ended on the device: the scheduler's `free` takes it out of the plan
    runner.join(1, SamplingParams.greedy(), p[:, -1], T, 6, 0, rows[1])
    runner.step(2, 200)  # an eager step stages the plan itself
    assert runner.prefixes.n_tiles == 1
    runner.apply(RowOp("free", 1))
    runner.launch(2, 200)
    assert runner.prefixes.n_tiles == 0
    # without the option: no plan, nothing handed over
    assert ModelRunner(fixture_model, n_rows=2, max_len=512, block_size=16,
                       ops=dataclasses.replace(ops, shared_prefix=False)).prefixes is None


def test_paged_decode_attend_with_a_kernel_makes_no_fallback_tensors(fixture_model):
    """With csrc's kernel the attend launches nothing of its own (the fallback's write
    offsets and mask would be three launches of every frame step that nothing reads); the
    fallback still makes them, once per attend."""
    import functools

    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.cache import PagedDecodeAttend, SlowKVCache
    from engine.kernels.decode_attention import decode_attention

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    cfg = fixture_model.cfg.slow
    cache = SlowKVCache(cfg, 4, 16, 64, device="cpu", dtype=torch.float32)
    tables, pos = torch.tensor([[0], [1]]), torch.tensor([3, 7])
    q = torch.randn(2, cfg.n_head, 1, cfg.head_dim)
    k = torch.randn(2, cfg.n_local_heads, 1, cfg.head_dim)
    kernel = functools.partial(decode_attention, kernel=False)
    wblock = tables[:, 0].clone()
    with Count() as made:
        attend = PagedDecodeAttend(cache, tables, wblock, pos, 16, kernel)
    assert made.ops == []
    with_kernel = attend(0, q, k, k)
    plain = PagedDecodeAttend(cache, tables, tables[:, 0].clone(), pos, 16)
    with Count() as first:
        got = plain(1, q, k, k)
    with Count() as second:
        plain(1, q, k, k)
    assert any("remainder" in op for op in first.ops)
    assert not any("remainder" in op for op in second.ops)  # made once per attend
    torch.testing.assert_close(got, with_kernel, rtol=1e-5, atol=1e-5)


def test_packed_semantic_head_matches_the_two_gemms(fixture_dir, fixture_model):
    """`Ops.packed_heads`: the semantic slice and <|im_end|> (scattered rows of the tied
    embedding) as one GEMM over a packed copy gives the logits of the two GEMMs and their
    concatenation; the copy is made once and remade when the weight changes in place."""
    import copy

    from engine.ops import REFERENCE, Ops

    m = copy.deepcopy(fixture_model)
    ids = m.cfg.ids
    packed = Ops(packed_heads=True)
    h = torch.randn(3, m.cfg.slow.dim)
    with torch.inference_mode():
        want = m.semantic_logits(h, REFERENCE)
        got = m.semantic_logits(h, packed)
    assert got.shape == (3, ids.n_semantic + 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    w = m.embeddings.weight
    rows = ((ids.semantic_start, ids.semantic_end + 1), (ids.im_end, ids.im_end + 1))
    first = w.__dict__["_gathered_rows"][rows][1]
    with torch.inference_mode():
        m.semantic_logits(h, packed)
    assert w.__dict__["_gathered_rows"][rows][1] is first  # made once
    with torch.no_grad():
        w[ids.im_end].mul_(2.0)  # an in-place edit of a packed row
    with torch.inference_mode():
        got2 = m.semantic_logits(h, packed)
        want2 = m.semantic_logits(h, REFERENCE)
    torch.testing.assert_close(got2, want2, rtol=0, atol=1e-5)
    assert not torch.equal(got2[:, -1], got[:, -1])
