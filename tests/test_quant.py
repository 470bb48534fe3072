"""FP8 weights (engine/quant.py): the block-scaled format, swapping a model's linears,
saving and reloading (bit-identical), `rtvoice quantize`, `--dtype fp8` through the loader,
the settings and an engine."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from engine import fusion
from engine.loader import load_bundle
from engine.model import gqa_attention
from engine.ops import REFERENCE, Ops
from engine.quant import (
    BLOCK,
    FP8,
    Fp8Linear,
    Fp8Weight,
    check_fp8,
    dequantize_fp8,
    fp8_layers,
    fp8_linear_torch,
    quantize_fp8,
    quantize_model,
)
from engine.runner import ModelRunner
from engine.sampler import SamplingParams
from engine.weights import CheckpointError, load_model, save_checkpoint


def test_block_scales_cover_each_128_block():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * 0.02
    w[:128, 128:256] *= 1000  # one loud block must not flatten its neighbours
    fw = quantize_fp8(w)
    assert fw.q.dtype == FP8 and fw.q.shape == (300, 260)
    assert fw.scale.shape == (3, 3) and fw.scale.dtype == torch.float32
    for i in range(3):
        for j in range(3):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            assert fw.scale[i, j] == pytest.approx(float(blk.abs().max()) / 448, rel=1e-6)
    back = dequantize_fp8(fw)
    # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |w| for normal values, plus the subnormal
    # step (2^-9 of the scale) for the smallest
    s = fw.scale.repeat_interleave(BLOCK, 0)[:300].repeat_interleave(BLOCK, 1)[:, :260]
    assert ((back - w).abs() <= w.abs() * 2**-4 + s * 2**-9).all()
    rel = float((back - w).norm() / w.norm())
    assert 0.005 < rel < 0.04  # really quantised, and not worse than e4m3 allows


def test_fp8_linear_is_the_dequantised_product():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g) * 0.02
    fw = quantize_fp8(w)
    x = torch.randn(2, 5, 384, generator=g)
    y = REFERENCE.linear(x, fw)
    assert y.shape == (2, 5, 256)
    assert torch.equal(y, x @ dequantize_fp8(fw).T)
    assert torch.equal(fp8_linear_torch(x, fw), y)
    assert torch.equal(REFERENCE.linear(x, w), torch.nn.functional.linear(x, w))


def test_contract_errors_name_the_problem():
    fw = quantize_fp8(torch.randn(256, 384))
    with pytest.raises(ValueError, match=r"must have shape \(2, 3\)"):
        check_fp8(fw.q, fw.scale.t().contiguous())  # the K-major layout
    with pytest.raises(ValueError, match="contiguous"):
        check_fp8(fw.q, fw.scale.t().contiguous().t())
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_fp8(fw.q.float(), fw.scale)
    with pytest.raises(ValueError, match="float32"):
        check_fp8(fw.q, fw.scale.double())
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_fp8(torch.randn(4))


@pytest.fixture(scope="module")
def tiny():
    return load_bundle("tiny").model


def test_quantize_model_swaps_the_layer_linears_only(tiny):
    m = copy.deepcopy(tiny)
    done = quantize_model(m, keep=("fast_layers.1.*", "layers.0.attention.wo"))
    assert done == fp8_layers(m)
    assert "layers.0.attention.wqkv" in done and "layers.0.attention.wo" not in done
    assert not any(n.startswith("fast_layers.1.") for n in done)
    assert isinstance(m.layers[0].attention.wo, nn.Linear)
    assert isinstance(m.fast_layers[0].feed_forward.w2, Fp8Linear)
    # heads and embeddings stay dense
    assert isinstance(m.fast_output, nn.Linear) and m.embeddings.weight.dtype == torch.float32
    w = m.layers[1].feed_forward.w1.weight
    assert isinstance(w, Fp8Weight) and w.shape == tiny.layers[1].feed_forward.w1.weight.shape
    with pytest.raises(ValueError, match="match no quantised layer"):
        quantize_model(copy.deepcopy(tiny), keep=("layer.3.wo",))


def _logits(model, cols: torch.Tensor, ops: Ops = REFERENCE) -> torch.Tensor:
    """Semantic logits at every position of one prompt, causal attention, no cache."""
    T = cols.shape[-1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]

    def attend(layer, q, k, v):  # type: ignore[no-untyped-def]
        return gqa_attention(q, k, v, mask)

    h = model.forward_slow(cols[None], torch.arange(T)[None], attend, ops)
    return model.semantic_logits(h, ops)[0]


def _cols(model, T: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    ids = model.cfg.ids
    tok = torch.randint(0, 200, (T,), generator=g)
    tok[T // 2:] = ids.semantic_start + torch.randint(0, 100, (T - T // 2,), generator=g)
    codes = torch.randint(0, model.cfg.codebook_size, (model.cfg.num_codebooks, T), generator=g)
    return torch.cat([tok[None], codes])


@pytest.fixture(scope="module")
def wide():
    """The tiny model at width 256: every linear has at least 2 x 2 scale blocks."""
    from dataclasses import replace

    from engine.config import preset
    from engine.weights import dummy_model

    c = preset("tiny")
    cfg = replace(c, slow=replace(c.slow, dim=256), fast=replace(c.fast, dim=256))
    return dummy_model(cfg, dtype=torch.float32)


def test_save_and_reload_give_bit_identical_logits(tmp_path, wide):
    """Saved and reloaded FP8 weights are the same bytes, and give bit-identical logits,
    even when a scale tensor in memory is a transposed view (saved in its logical, row-major
    order: the seed's K-major bug cannot happen through save_checkpoint)."""
    m = copy.deepcopy(wide)
    quantize_model(m)
    fusion.pack_ffn(m)  # W1|W3 as views into one buffer: saved as their own tensors
    lin = m.layers[0].attention.wqkv
    lin.weight_scale_inv = lin.weight_scale_inv.t().contiguous().t()  # column-major storage
    assert not lin.weight_scale_inv.is_contiguous()
    cols = _cols(m)
    # the in-memory model reads the view in its logical order too
    want = _logits(m, cols)
    save_checkpoint(m, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    back = load_model(tmp_path / "q", dtype=torch.float32, fp8=True)
    assert fp8_layers(back) == fp8_layers(m)
    for (n, a), (n2, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n == n2 and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                           b.view(torch.uint8) if b.dtype == FP8 else b), n
    assert torch.equal(_logits(back, cols), want)
    # without fp8 the same checkpoint loads dequantised: the same products
    dense = load_model(tmp_path / "q", dtype=torch.float32)
    assert not fp8_layers(dense)
    assert torch.equal(_logits(dense, cols), want)


def _quantised_shard(tmp_path, wide):  # type: ignore[no-untyped-def]
    """`wide` quantised and saved under tmp_path / "q": (its shard, the shard's tensors)."""
    from safetensors.torch import load_file

    m = copy.deepcopy(wide)
    quantize_model(m)
    save_checkpoint(m, tmp_path / "q")
    shard = next((tmp_path / "q").glob("model-*.safetensors"))
    return shard, load_file(str(shard))


def test_a_scale_saved_in_the_wrong_layout_is_refused(tmp_path, wide):
    from safetensors.torch import save_file

    shard, t = _quantised_shard(tmp_path, wide)
    key = "text_model.model.layers.0.feed_forward.w2.weight_scale_inv"
    assert t[key].shape[0] != t[key].shape[1]
    t[key] = t[key].t().contiguous()
    save_file(t, str(shard))
    with pytest.raises(CheckpointError, match="w2"):
        load_model(tmp_path / "q", fp8=True)


def test_fp8_model_decodes_close_to_dense(tiny):
    """Greedy frames of the FP8 tiny model through the runner: the same path as dense, and
    the semantic logits within FP8's error of the dense ones."""
    m = copy.deepcopy(tiny)
    quantize_model(m)
    cols = _cols(m)
    dense, fp8 = _logits(tiny, cols), _logits(m, cols)
    rel = float((fp8 - dense).norm() / dense.norm())
    assert 1e-4 < rel < 0.1
    runner = ModelRunner(m, n_rows=1, max_len=256)
    blocks = runner.own_blocks(0)
    runner.prefill(blocks, cols[:, :-1], 0)
    runner.join(0, SamplingParams.greedy(), cols[:, -1], cols.shape[1] - 1, 8, 0, blocks)
    frames = torch.stack([runner.step(1, 64)[0, :11] for _ in range(8)], dim=1)
    assert frames.shape == (11, 8)
    ids = m.cfg.ids
    assert ((frames[0] >= ids.semantic_start) | (frames[0] == ids.im_end)).all()


def test_packed_fp8_ffn_is_one_gemm_with_the_same_result(tiny):
    m = copy.deepcopy(tiny)
    quantize_model(m)
    if m.cfg.slow.intermediate_size % BLOCK:
        pytest.skip("FFN width not a multiple of the scale block")
    ff = m.layers[0].feed_forward
    x = torch.randn(2, 3, m.cfg.slow.dim)
    want = REFERENCE.swiglu(x, ff.w1.weight, ff.w3.weight)
    assert fusion.pack_ffn(m) == m.cfg.slow.n_layer + m.cfg.fast.n_layer
    both = fusion.packed(ff.w1.weight, ff.w3.weight)
    assert isinstance(both, Fp8Weight) and both.shape[0] == 2 * m.cfg.slow.intermediate_size
    both.check()
    calls: list[int] = []

    def counting(x, w):  # type: ignore[no-untyped-def]
        calls.append(w.shape[0])
        return fp8_linear_torch(x, w)

    got = Ops(packed_ffn=True, linear=counting).swiglu(x, ff.w1.weight, ff.w3.weight)
    assert calls == [2 * m.cfg.slow.intermediate_size]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dense_copies_are_the_dequantised_weights_packed_like_their_values(tiny):
    """fusion.add_dense_copies gives every FP8 linear the bf16 weight `fp8_linear_torch`
    multiplies by (so F.linear on it is the FP8 reference bit for bit), packed W1|W3 get one
    adjacent copy (one GEMM, `packed` carries it), the copies are never saved, and a second
    call adds nothing. Where the plan measured no shape faster in bf16, nothing is added."""
    from engine.kernels import linear

    m = copy.deepcopy(tiny)
    quantize_model(m)
    fusion.pack_ffn(m)
    saved = set(m.state_dict())
    names = fp8_layers(m)
    rows = [{"fp8": fp8, "m": 8, "n": 7, "k": 64, "impl": "library", "us": {"library": t}}
            for fp8, t in ((True, 1.0), (False, 2.0))]
    assert fusion.add_dense_copies_where_faster(m, linear.LinearPlan.from_rows(rows)) == 0
    assert fusion.add_dense_copies_where_faster(m, None) == 0
    want = sum(m.get_submodule(n).qweight.numel() * 2 for n in names)
    assert fusion.add_dense_copies(m) == want
    assert fusion.add_dense_copies(m) == 0
    assert set(m.state_dict()) == saved  # derived: not part of a checkpoint
    x = torch.randn(3, m.cfg.slow.dim).to(torch.bfloat16)
    for n in names:
        w = m.get_submodule(n).weight
        assert w.dense is not None and w.dense.dtype == torch.bfloat16
        assert torch.equal(w.dense, dequantize_fp8(w, torch.bfloat16))
        if w.shape[1] == x.shape[1]:
            assert torch.equal(torch.nn.functional.linear(x, w.dense), fp8_linear_torch(x, w))
    ff = m.layers[0].feed_forward
    both = fusion.packed(ff.w1.weight, ff.w3.weight)
    if m.cfg.slow.intermediate_size % BLOCK == 0:
        assert both is not None and both.dense is not None
        assert torch.equal(both.dense, dequantize_fp8(both, torch.bfloat16))
        assert both.dense.data_ptr() == ff.w1.weight.dense.data_ptr()


def test_dense_copies_by_shape_packed_later_and_dropped_on_oom(tiny, monkeypatch):
    """Copies go to the layers whose shape pays (a packed W1|W3 by its packed shape, its
    halves never one by one); pack_ffn after the copies packs them too; running out of memory
    midway drops every copy made in that call and re-raises; build_engine's copy step names
    the option that avoids it."""
    from engine.engine import add_fp8_copies
    from engine.errors import EngineOutOfMemory

    m = copy.deepcopy(tiny)
    quantize_model(m)
    fusion.pack_ffn(m)
    ff = m.layers[0].feed_forward
    two_i, d = 2 * ff.w1.qweight.shape[0], ff.w1.qweight.shape[1]
    wqkv = m.layers[0].attention.wqkv
    fusion.add_dense_copies(m, pays=lambda n, k: (n, k) == tuple(wqkv.qweight.shape))
    assert wqkv.dense_weight is not None
    assert ff.w1.dense_weight is None and ff.w2.dense_weight is None  # not their shapes
    fusion.add_dense_copies(m, pays=lambda n, k: (n, k) == (two_i, d))
    assert ff.w1.dense_weight is not None and ff.w2.dense_weight is None
    assert fusion.packed(ff.w1.weight, ff.w3.weight).dense is not None
    # copies first, packing after
    late = copy.deepcopy(tiny)
    quantize_model(late)
    fusion.add_dense_copies(late)
    fusion.pack_ffn(late)
    lf = late.layers[0].feed_forward
    both = fusion.packed(lf.w1.weight, lf.w3.weight)
    assert both is not None and both.dense is not None
    assert torch.equal(both.dense, dequantize_fp8(both, torch.bfloat16))
    # out of memory on the third copy: none of this call's copies stay
    oom = copy.deepcopy(tiny)
    quantize_model(oom)
    real, calls = fusion.dequantize_fp8, []

    def failing(w, dtype):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real(w, dtype)

    monkeypatch.setattr(fusion, "dequantize_fp8", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fusion.add_dense_copies(oom)
    assert all(oom.get_submodule(n).dense_weight is None for n in fp8_layers(oom))

    class Pays:
        def dense_pays(self, n: int, k: int, fp8_activations: bool = False) -> bool:
            return True

        def rowwise_pays(self, n: int, k: int, dense: bool = True) -> bool:
            return True

    calls.clear()
    with pytest.raises(EngineOutOfMemory, match="no-fp8-dense-copy"):
        add_fp8_copies(oom, Pays(), None)
    # the rowwise copies (fp8_activations) drop what they made too
    real_rw, rw_calls = fusion.rowwise_fp8, []

    def failing_rw(w):  # type: ignore[no-untyped-def]
        rw_calls.append(1)
        if len(rw_calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real_rw(w)

    monkeypatch.setattr(fusion, "dequantize_fp8", real)
    monkeypatch.setattr(fusion, "rowwise_fp8", failing_rw)
    with pytest.raises(EngineOutOfMemory, match="fp8-activations"):
        add_fp8_copies(oom, Pays(), Pays())
    # none of the copies made before it stays (the dense ones neither)
    assert all(oom.get_submodule(n).rowwise_q is None for n in fp8_layers(oom))
    assert all(oom.get_submodule(n).dense_weight is None for n in fp8_layers(oom))
    assert len(rw_calls) == 3


def test_quantize_cli(tmp_path, fixture_dir):
    from rtvoice.cli import main

    out = tmp_path / "fp8"
    assert main(["quantize", str(fixture_dir), str(out), "--keep", "layers.0.*"]) == 0
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3"
    assert "text_model.model.layers.0.attention.wqkv" in q["modules_to_not_convert"]
    assert (out / "tokenizer.json").is_file() and (out / "codec.safetensors").is_file()
    assert config["text_config"] == json.loads((fixture_dir / "config.json").read_text())[
        "text_config"]
    from engine.inspect_checkpoint import inspect_checkpoint

    report = inspect_checkpoint(str(out))
    assert not report.problems and "FP8: 15 linears" in report.text()
    b = load_bundle(str(out), dtype="fp8")
    names = fp8_layers(b.model)
    assert names and not any(n.startswith("layers.0.") for n in names)
    # a non-empty output, an already quantised source, a keep list on a quantised checkpoint
    assert main(["quantize", str(fixture_dir), str(out)]) == 2
    assert main(["quantize", str(out), str(tmp_path / "again")]) == 2
    with pytest.raises(CheckpointError, match="already quantised"):
        load_bundle(str(out), dtype="fp8", fp8_keep=("layers.1.*",))
    assert main(["quantize", str(fixture_dir), str(out), "--overwrite"]) == 0
    assert fp8_layers(load_bundle(str(out), dtype="fp8").model)[0] == "layers.0.attention.wqkv"


def test_dtype_fp8_settings_and_loader():
    from rtvoice.settings import ModelSettings

    assert ModelSettings(dtype="FP8").dtype == "fp8"
    with pytest.raises(ValueError, match="unknown"):
        ModelSettings(dtype="int4")
    with pytest.raises(ValueError, match="needs dtype fp8"):  # what `serve` reports at start
        load_bundle("tiny", fp8_keep=("layers.0.*",))
    b = load_bundle("tiny", dtype="fp8", fp8_keep=("fast_layers.*",))
    assert fp8_layers(b.model) and not any(n.startswith("fast") for n in fp8_layers(b.model))
    assert b.model.embeddings.weight.dtype == torch.float32  # the CPU's default dtype


def test_engine_speaks_with_fp8_weights():
    from engine.config import EngineConfig
    from engine.engine import CollectingSink, build_engine

    b = load_bundle("tiny", dtype="fp8")
    eng = build_engine(b, EngineConfig(max_running=2, max_len=512, pingpong=False))
    sink = CollectingSink()
    seq = eng.open([], SamplingParams(seed=2), sink)
    eng.run_until_idle()
    assert sink.ready.is_set() and not sink.errors
    eng.submit(seq, "hello there", turn_id="t", max_frames=12)
    eng.run_until_idle()
    assert sink.done.is_set() and not sink.errors, sink.errors
    assert 0 < sink.results[0].frames <= 12
    assert sink.pcm().size == sink.results[0].frames * 2048


def test_fp8_gate_command(tmp_path):
    """`rtvoice fp8-gate` runs engine.fp8_gate with its own options (the planted small model
    on a CPU) and exits 0 on a pass, 1 when the bound cannot be met."""
    from rtvoice.cli import main

    out = tmp_path / "gate.json"
    assert main(["fp8-gate", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert main(["fp8-gate", "--bound", "1e-6"]) == 1


@pytest.mark.parametrize("fp8", [True, False])
def test_nan_codes_and_bad_scales_are_refused_at_load(tmp_path, wide, fp8):
    """An FP8 checkpoint with an e4m3 NaN code (0x7F / 0xFF, which the kernels' conversions
    read differently) or a non-finite or negative block scale is refused at load, naming the
    layer and what to do, whether it loads as FP8 or dequantised."""
    from safetensors.torch import save_file

    shard, clean = _quantised_shard(tmp_path, wide)
    key = "text_model.model.layers.1.attention.wo.weight"
    for what, edit in (("NaN", lambda t: t[key].view(torch.uint8).view(-1).__setitem__(5, 0xFF)),
                       ("not finite", lambda t: t[key + "_scale_inv"].view(-1).__setitem__(
                           0, float("inf"))),
                       ("negative", lambda t: t[key + "_scale_inv"].view(-1).__setitem__(
                           1, -0.5))):
        t = {k: v.clone() for k, v in clean.items()}
        edit(t)
        save_file(t, str(shard))
        with pytest.raises(CheckpointError, match=f"wo.*{what}.*rtvoice quantize"):
            load_model(tmp_path / "q", dtype=torch.float32, fp8=fp8)
    save_file(clean, str(shard))
    load_model(tmp_path / "q", dtype=torch.float32, fp8=fp8)  # the clean one loads
