"""Codec: fixture agreement, weight loading, config validation, sizes, dummy weights, resampling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _paths import fixture_set, require_fixtures
from safetensors.torch import load_file, save_file

from engine.codec import Codec, CodecConfig, dummy_codec, load_codec, resample_to_codec_rate
from engine.codec.reference_checks import codec_checks, deterministic

FIXTURE = fixture_set()
# conftest's fixture_dir: skips without the fixture set, fails under CI
needs_fixture = pytest.mark.usefixtures("fixture_dir")

CHECK_NAMES = [
    "decode.quantizer_latent",
    "decode.audio",
    "decode_clamp.audio",
    "encode.encoder_latent",
    "encode.codes",
    "encode.feature_lengths",
    "encode.roundtrip_audio",
    *[f"stream[chunk={c}].{case}.audio" for case in ("decode", "decode_clamp") for c in (1, 3, 7)],
    "stream[batched 2 streams, chunks 1+7].audio",
]


def _random_codes(frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sem = torch.randint(0, 4096, (batch, 1, frames), generator=g)
    res = torch.randint(0, 1024, (batch, 9, frames), generator=g)
    return torch.cat([sem, res], dim=1)


@pytest.fixture(scope="module")
def fixture_codec() -> Codec:
    return load_codec(require_fixtures(FIXTURE))


@pytest.fixture(scope="module")
def check_results(fixture_codec: Codec) -> dict[str, tuple[bool, str]]:
    return {name: (ok, detail) for name, ok, detail in codec_checks(FIXTURE, codec=fixture_codec)}


# ---------------------------------------------------------------------------------------------
# Agreement with the reference outputs
# ---------------------------------------------------------------------------------------------
@needs_fixture
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_reference_check(check_results: dict[str, tuple[bool, str]], name: str) -> None:
    assert name in check_results, f"check {name} not produced; got {sorted(check_results)}"
    ok, detail = check_results[name]
    assert ok, f"{name}: {detail}"


@needs_fixture
def test_checks_cover_every_case(check_results: dict[str, tuple[bool, str]]) -> None:
    assert set(check_results) == set(CHECK_NAMES)


@needs_fixture
def test_decode_clamps_on_a_copy(fixture_codec: Codec) -> None:
    cases = load_file(str(FIXTURE / "codec_cases.safetensors"))
    codes = cases["decode_clamp.codes"].clone()
    assert int(codes[:, 1:].max()) > 1023  # the case really exercises the clamp
    with deterministic():
        a = fixture_codec.decode(codes)
        b = fixture_codec.decode(codes.clamp(max=torch.tensor([4095] + [1023] * 9)[None, :, None]))
    assert torch.equal(codes, cases["decode_clamp.codes"]), "decode modified its input"
    assert torch.equal(a, b)
    assert fixture_codec.quantizer.decode(codes).shape == (1, 64, 16 * 4)


@needs_fixture
def test_encode_batch_and_lengths(fixture_codec: Codec) -> None:
    cases = load_file(str(FIXTURE / "codec_cases.safetensors"))
    audio = cases["encode.audio"]
    n = audio.shape[0]
    batch = torch.zeros(2, 1, n)
    batch[0, 0] = audio
    batch[1, 0, :5000] = audio[:5000]
    with deterministic():
        codes, frames = fixture_codec.encode(batch, torch.tensor([n, 5000]))
    assert codes.shape == (2, 10, 28) and codes.dtype == torch.long
    assert frames.tolist() == [28, 3]
    assert torch.equal(codes[0], cases["encode.codes"][0])
    # [B, N] input and default lengths
    codes2, frames2 = fixture_codec.encode(audio[None, : 2048 * 3 + 1])
    assert codes2.shape == (1, 10, 4) and frames2.tolist() == [4]


def test_encode_rejects_bad_input() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"))
    with pytest.raises(ValueError, match="mono"):
        codec.encode(torch.zeros(1, 2, 4096))
    with pytest.raises(TypeError, match="floating-point"):
        codec.encode(torch.zeros(1, 1, 4096, dtype=torch.long))
    with pytest.raises(ValueError, match="lengths"):
        codec.encode(torch.zeros(1, 1, 4096), torch.tensor([5000]))
    with pytest.raises(ValueError, match="empty"):
        codec.encode(torch.zeros(1, 1, 0))


def test_decode_rejects_bad_codes() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"))
    with pytest.raises(ValueError, match=r"\[B, 10, T\]"):
        codec.decode(torch.zeros(1, 9, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer dtype"):
        codec.decode(torch.zeros(1, 10, 4))
    with pytest.raises(ValueError, match="negative"):
        codec.decode(torch.full((1, 10, 4), -1))
    assert codec.decode(torch.zeros(2, 10, 0, dtype=torch.long)).shape == (2, 1, 0)


# ---------------------------------------------------------------------------------------------
# Weight loading
# ---------------------------------------------------------------------------------------------
def _copy_fixture(
    tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "codec.safetensors"
) -> Path:
    d = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    shutil.copy(FIXTURE / "codec_config.json", d / "codec_config.json")
    if name.endswith(".safetensors"):
        save_file(tensors, str(d / name))
    else:
        torch.save(tensors, str(d / name))
    return d


def _decode_small(codec: Codec) -> torch.Tensor:
    with deterministic():
        return codec.decode(_random_codes(3))


@needs_fixture
def test_load_missing_key(tmp_path: Path) -> None:
    sd = load_file(str(FIXTURE / "codec.safetensors"))
    del sd["decoder.model.0.conv.bias"]
    with pytest.raises(ValueError, match=r"missing codec tensor 'decoder\.model\.0\.conv\.bias'"):
        load_codec(_copy_fixture(tmp_path, sd))


@needs_fixture
def test_load_skips_unknown_tensors_with_one_warning(tmp_path: Path, fixture_codec: Codec,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Like the reference (strict=False): an unknown extra tensor is skipped with one warning
    naming it; rebuilt buffers are skipped silently; the audio is the fixture codec's."""
    import logging

    sd = load_file(str(FIXTURE / "codec.safetensors"))
    sd["decoder.extra.weight"] = torch.zeros(3)
    sd["quantizer.post_module.freqs_cis"] = torch.zeros(4, 2)  # reference buffer: rebuilt
    with caplog.at_level(logging.WARNING, logger="engine.codec.weights"):
        codec = load_codec(_copy_fixture(tmp_path, sd))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "decoder.extra.weight" in warnings[0]
    assert "freqs_cis" not in warnings[0]
    assert torch.equal(_decode_small(codec), _decode_small(fixture_codec))


@needs_fixture
@pytest.mark.parametrize("naming", ["parametrizations", "weight_g_v"])
def test_load_codec_pth_as_the_real_file_holds_it(tmp_path: Path, fixture_codec: Codec,
                                                  naming: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The real codec.pth's layout: {"state_dict": {"generator.*": ...}} with the
    discriminator's weights beside it, bool causal masks and bf16 RoPE tables (buffers the
    reference saves and rebuilds), in either weight-norm naming. It loads (memory-mapped),
    warns about nothing, and decodes like the fixture codec; codec_keys groups the keys."""
    import logging

    from engine.codec import CodecConfig, codec_keys, fold_weight_norm, read_checkpoint

    sd = load_file(str(FIXTURE / "codec.safetensors"))
    real = {}
    for k, v in sd.items():
        if naming == "weight_g_v":
            k = k.replace(".parametrizations.weight.original0", ".weight_g")
            k = k.replace(".parametrizations.weight.original1", ".weight_v")
        real["generator." + k] = v
    real["generator.quantizer.post_module.causal_mask"] = torch.ones(64, 64, dtype=torch.bool)
    real["generator.quantizer.pre_module.causal_mask"] = torch.ones(32, 32, dtype=torch.bool)
    real["generator.quantizer.post_module.freqs_cis"] = torch.zeros(64, 8, 2, dtype=torch.bfloat16)
    real["discriminator.convs.0.weight"] = torch.zeros(4, 4)
    d = _copy_fixture(tmp_path, {"state_dict": real}, name="codec.pth")
    with caplog.at_level(logging.WARNING, logger="engine.codec.weights"):
        codec = load_codec(d)
    assert not caplog.records
    assert torch.equal(_decode_small(codec), _decode_small(fixture_codec))
    keys = codec_keys(fold_weight_norm(read_checkpoint(d / "codec.pth")),
                      CodecConfig.from_file(d / "codec_config.json"))
    assert not keys.problems and not keys.ignored and len(keys.loaded) > 100
    assert sorted(keys.rebuilt) == ["quantizer.post_module.causal_mask",
                                    "quantizer.post_module.freqs_cis",
                                    "quantizer.pre_module.causal_mask"]


@needs_fixture
def test_load_wrong_shape(tmp_path: Path) -> None:
    sd = load_file(str(FIXTURE / "codec.safetensors"))
    sd["quantizer.post_module.norm.weight"] = torch.ones(63)
    with pytest.raises(ValueError, match=r"'quantizer\.post_module\.norm\.weight'.*\[63\].*\[64\]"):
        load_codec(_copy_fixture(tmp_path, sd))
    # a wrong weight-norm magnitude shape is named too
    sd = load_file(str(FIXTURE / "codec.safetensors"))
    sd["decoder.model.0.conv.parametrizations.weight.original0"] = torch.ones(64)
    with pytest.raises(ValueError, match=r"original0'.*\[64\].*\[64, 1, 1\]"):
        load_codec(_copy_fixture(tmp_path, sd))


@needs_fixture
def test_load_unpaired_weight_norm(tmp_path: Path) -> None:
    sd = load_file(str(FIXTURE / "codec.safetensors"))
    del sd["quantizer.quantizer.quantizers.3.in_proj.weight_g"]
    with pytest.raises(
        ValueError, match=r"quantizers\.3\.in_proj\.weight_v.*no matching.*weight_g"
    ):
        load_codec(_copy_fixture(tmp_path, sd))


@needs_fixture
def test_load_pth_generator_prefix_and_old_weight_norm_names(
    tmp_path: Path, fixture_codec: Codec
) -> None:
    sd = load_file(str(FIXTURE / "codec.safetensors"))
    renamed = {}
    for k, v in sd.items():
        # parametrization names -> old weight_g / weight_v names, plus a generator. prefix
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        renamed["generator." + k] = v
    renamed["discriminator.some.weight"] = torch.zeros(2)  # dropped with the prefix filter
    d = _copy_fixture(tmp_path, {"state_dict": renamed}, name="codec.pth")
    codec = load_codec(d)
    assert torch.equal(_decode_small(codec), _decode_small(fixture_codec))
    # a weights file path works too (config found next to it)
    codec2 = load_codec(d / "codec.pth", cfg=CodecConfig.from_file(d / "codec_config.json"))
    assert torch.equal(_decode_small(codec2), _decode_small(fixture_codec))
    assert not codec.training
    assert all(not p.requires_grad for p in codec.parameters())


@needs_fixture
def test_load_fold_matches_torch_weight_norm(fixture_codec: Codec) -> None:
    sd = load_file(str(FIXTURE / "codec.safetensors"))
    # transposed conv: norm per INPUT channel (dim 0 of [in, out, k])
    g = sd["decoder.model.1.block.1.conv.parametrizations.weight.original0"]
    v = sd["decoder.model.1.block.1.conv.parametrizations.weight.original1"]
    w = fixture_codec.decoder.model[1].block[1].conv.weight
    assert torch.equal(w, torch._weight_norm(v, g, 0))
    assert torch.allclose(w.norm(dim=(1, 2)), g.flatten(), rtol=1e-5)


def test_load_errors_on_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_codec(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"no codec\.safetensors or codec\.pth"):
        load_codec(tmp_path)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@needs_fixture
def test_config_from_file_equals_tiny_preset() -> None:
    cfg = CodecConfig.from_file(FIXTURE / "codec_config.json")
    assert cfg == CodecConfig.preset("tiny")
    assert cfg.sample_rate == 44100
    assert cfg.hop_length == cfg.frame_length == 2048
    assert cfg.encoder_hop_length == 512
    assert cfg.n_codebooks_total == 10
    assert cfg.quantizer.post_module is not None and cfg.quantizer.post_module.window_size == 4


def _tiny_dict() -> dict:
    return json.loads((require_fixtures(FIXTURE) / "codec_config.json").read_text())


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(bogus=1), "unknown field 'bogus'"),
        (lambda d: d.update(decoder_rates=[8, 8, 4, 4]), "prod\\(encoder_rates\\)"),
        (lambda d: d.update(encoder_rates=[2, 0, 8, 8]), "encoder_rates\\[1\\]"),
        (lambda d: d.update(encoder_transformer_layers=[0, 0, 1]), "encoder_transformer_layers"),
        (lambda d: d.update(sample_rate=-1), "sample_rate"),
        (lambda d: d.update(decoder_dim="64"), "decoder_dim"),
        (lambda d: d.update(encoder_dim=8), "quantizer.input_dim"),
        (lambda d: d["quantizer"].update(n_codebooks=0), "n_codebooks"),
        (lambda d: d["quantizer"].update(codebook_size=1.5), "codebook_size"),
        (lambda d: d["quantizer"]["post_module"].update(window_size=None), "window_size"),
        (lambda d: d["quantizer"]["post_module"].update(input_dim=32), "post_module.input_dim"),
        (
            lambda d: d["quantizer"]["post_module"]["config"].update(n_local_heads=1),
            "n_local_heads",
        ),
        (lambda d: d["quantizer"]["pre_module"]["config"].update(head_dim=31), "head_dim"),
        (
            lambda d: d["transformer_general_config"].update(pos_embed_type="conformer"),
            "pos_embed_type",
        ),
        (lambda d: d.update(causal=False), "causal"),
    ],
)
def test_config_validation_errors(edit, match: str) -> None:
    d = _tiny_dict()
    edit(d)
    with pytest.raises(ValueError, match=match):
        CodecConfig.from_dict(d)


def test_config_misc_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown codec preset"):
        CodecConfig.preset("huge")
    with pytest.raises(FileNotFoundError):
        CodecConfig.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CodecConfig.from_file(bad)


def test_s2pro_preset_sizes_on_meta() -> None:
    cfg = CodecConfig.preset("s2-pro")
    assert cfg.latent_dim == 1024 and cfg.decoder_dim == 1536
    assert cfg.frame_length == 2048 and cfg.n_codebooks_total == 10
    with torch.device("meta"):
        codec = Codec(cfg)

    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    q = codec.quantizer
    decode_side = (
        count(codec.decoder)
        + count(q.post_module)
        + count(q.upsample)
        + sum(
            count(vq.out_proj) + count(vq.codebook)
            for rvq in (q.semantic_quantizer, q.quantizer)
            for vq in rvq.quantizers
        )
    )
    total = count(codec)
    # Measured: whole codec 391.40 M (encoder 76.84 M, pre/post transformers 109.09 M each,
    # decoder 54.09 M); the decode path (what streaming runs) is 184.38 M.
    assert abs(total - 391.40e6) < 0.05e6, total
    assert abs(decode_side - 184.38e6) < 0.05e6, decode_side
    assert abs(count(codec.decoder) - 54.09e6) < 0.05e6
    assert abs(count(q.post_module) - 109.09e6) < 0.05e6
    p = q.post_module
    assert len(p.layers) == 8 and p.window_size == 128
    assert p.layers[0].attention.wqkv.weight.shape == (3 * 1024, 1024)
    assert p.layers[0].feed_forward.w1.weight.shape == (3072, 1024)
    enc_t = codec.encoder.block[4].block[5]
    assert len(enc_t.layers) == 4 and enc_t.layers[0].attention.n_head == 16


# ---------------------------------------------------------------------------------------------
# Dummy weights
# ---------------------------------------------------------------------------------------------
def test_dummy_codec_deterministic_and_sane() -> None:
    cfg = CodecConfig.preset("tiny")
    a, b, c = dummy_codec(cfg, seed=3), dummy_codec(cfg, seed=3), dummy_codec(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    with deterministic():
        audio = a.decode(_random_codes(20, batch=2))
    assert audio.shape == (2, 1, 20 * 2048)
    assert torch.isfinite(audio).all()
    assert 0.05 < float(audio.std()) < 0.7
    assert float((audio.abs() > 0.99).float().mean()) < 0.01  # not saturated
    # encode works on the dummy too, and round-trips to valid code ranges
    codes, frames = a.encode(audio[:1, :, :5000])
    assert codes.shape == (1, 10, 3) and frames.tolist() == [3]
    assert int(codes[:, 0].max()) < 4096 and int(codes[:, 1:].max()) < 1024


def test_dummy_codec_dtype_device() -> None:
    codec = dummy_codec(CodecConfig.preset("tiny"), seed=0, dtype=torch.float64)
    assert codec.dtype == torch.float64
    assert codec.decode(_random_codes(2)).dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# Resampling
# ---------------------------------------------------------------------------------------------
def _tone(sr: int, seconds: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / sr)[spec.argmax()])


@pytest.mark.parametrize("sr", [8000, 16000, 22050, 24000, 48000])
def test_resample_rates(sr: int) -> None:
    y = resample_to_codec_rate(_tone(sr), sr)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - 22050) <= 2
    assert abs(_peak_hz(y, 44100) - 440.0) < 5.0
    assert 0.45 < float(np.abs(y[1000:-1000]).max()) < 0.55


def test_resample_kinds_and_errors() -> None:
    x = _tone(44100)
    assert np.array_equal(resample_to_codec_rate(x, 44100), x)  # no-op at the codec rate
    t = resample_to_codec_rate(torch.from_numpy(_tone(16000)), 16000)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    stereo = np.stack([_tone(16000), _tone(16000)], axis=1)  # [N, 2] (soundfile layout)
    assert resample_to_codec_rate(stereo, 16000).shape == (22050,)
    assert resample_to_codec_rate(stereo.T, 16000).shape == (22050,)  # [2, N]
    pcm = (np.clip(_tone(16000), -1, 1) * 32767).astype(np.int16)
    assert 0.45 < float(np.abs(resample_to_codec_rate(pcm, 16000)).max()) < 0.55
    with pytest.raises(ValueError, match="sr"):
        resample_to_codec_rate(x, 0)
    with pytest.raises(ValueError, match="empty"):
        resample_to_codec_rate(np.zeros(0, np.float32), 16000)
    with pytest.raises(ValueError, match="NaN"):
        resample_to_codec_rate(np.array([0.0, np.nan], np.float32), 16000)
    with pytest.raises(TypeError):
        resample_to_codec_rate([0.0, 1.0], 16000)  # type: ignore[arg-type]


def _script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/<name> run from the repository root, its output captured."""
    return subprocess.run([sys.executable, f"scripts/{name}", *args], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parent.parent,
                          env={**os.environ, "PYTHONPATH": "."})


def test_codec_flops_script_counts_every_conv_output(tmp_path: Path) -> None:
    """scripts/codec_flops.py (the arithmetic PERF.md prices a codec tick with) against an
    independent count over the S2-Pro decoder's convs from forward hooks on the meta device:
    2 x outputs x input channels per group x taps (a transposed conv: 2 x inputs x output
    channels per group x taps)."""
    out = tmp_path / "flops.json"
    run = _script("codec_flops.py", "--ticks", "4x2,2x3", "--json", str(out))
    assert run.returncode == 0, run.stderr
    ticks = json.loads(out.read_text())["ticks"]
    assert [(t["streams"], t["frames"]) for t in ticks] == [(4, 2), (2, 3)]
    with torch.device("meta"):
        codec = Codec(CodecConfig.preset("s2-pro"))
    total = {"conv": 0}

    def hook(mod: torch.nn.Module, inp: tuple, y: torch.Tensor) -> None:
        taps = mod.kernel_size[0]
        if isinstance(mod, torch.nn.ConvTranspose1d):  # each input meets every tap of its group
            total["conv"] += 2 * inp[0].numel() * mod.out_channels // mod.groups * taps
        else:  # each output sums every tap of its group's inputs
            total["conv"] += 2 * y.numel() * mod.in_channels // mod.groups * taps

    for m in codec.modules():
        if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
            m.register_forward_hook(hook)
    for tick in ticks:
        total["conv"] = 0
        codes = torch.zeros(tick["streams"], codec.n_codebooks_total, tick["frames"],
                            dtype=torch.long, device="meta")
        with torch.no_grad():
            codec.decoder(codec.quantizer.decode(codes))
        assert tick["by_op"]["convolution"] == total["conv"] > 0
        assert tick["gflop_per_frame"] == pytest.approx(
            tick["flops"] / (tick["streams"] * tick["frames"]) / 1e9)


def test_codec_op_count_script_counts_a_pass(tmp_path: Path) -> None:
    """scripts/codec_op_count.py (PERF.md's op counts of a codec pass): with the compiled
    codec ops, each is one op, called as often as the S2-Pro post-module's 8 layers call it
    (2 norms and 2 LayerScale'd adds per layer and the final norm, one RoPE and one silu * mul
    per layer, one ring window and one codebook lookup per pass) and one tail cut per
    stateful conv (20), and the
    pass has fewer ops than with the torch formulas; the same convolutions but the
    codebooks' 1x1 projections."""
    out = tmp_path / "ops.json"
    run = _script("codec_op_count.py", "--ticks", "2x2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    got = json.loads(out.read_text())
    state = got["state_bytes_per_stream"]
    assert state["rings"] > 10 * state["gathered"] > 0  # the K/V rings: most of the state
    row = got["2x2"]
    eager, compiled = row["eager"], row["compiled"]
    assert {k: v for k, v in compiled.items() if k.startswith("compiled:")} == {
        "compiled:rms_norm": 17, "compiled:norm_rope_qk": 8, "compiled:silu_mul": 8,
        "compiled:add_scaled": 16, "compiled:ring_window": 1, "compiled:take_last": 20,
        "compiled:lookup_sum": 1}
    assert not any(k.startswith("compiled:") for k in eager)
    # the same convolutions but the 10 codebooks' 1x1 out_proj (in their projected tables)
    assert compiled["convolution"] == eager["convolution"] - 10 > 0
    assert sum(compiled.values()) < sum(eager.values())
    bad = _script("codec_op_count.py", "--ticks", "2x17")
    assert bad.returncode == 2 and "frames in 1..16" in bad.stderr
