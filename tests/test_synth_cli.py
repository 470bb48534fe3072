"""`rtvoice synth`: offline synthesis to a WAV, with and without a reference clip."""

from __future__ import annotations

import numpy as np
import soundfile as sf

from rtvoice.cli import main


def test_synth_writes_wav(tmp_path, capsys):
    out = tmp_path / "out.wav"
    rc = main(["synth", "Hello world.", "-o", str(out), "--max-frames", "6", "--seed", "1"])
    assert rc == 0
    audio, sr = sf.read(str(out))
    assert sr == 44100 and len(audio) == 6 * 2048
    assert np.abs(audio).max() > 0
    assert "wrote" in capsys.readouterr().out


def test_synth_with_reference_clip_at_another_rate(tmp_path):
    ref = tmp_path / "ref.flac"
    t = np.arange(16000) / 16000
    sf.write(str(ref), 0.3 * np.sin(2 * np.pi * 220 * t), 16000)  # 1 s at 16 kHz
    out = tmp_path / "cloned.wav"
    rc = main(["synth", "مرحبا", "-o", str(out), "--reference", str(ref),
               "--reference-text", "A test tone.", "--max-frames", "4"])
    assert rc == 0
    assert sf.info(str(out)).frames == 4 * 2048


def test_synth_errors_are_clear(tmp_path, capsys):
    rc = main(["synth", "x", "-o", str(tmp_path / "a.wav"), "--reference", str(tmp_path / "nope.wav"),
               "--reference-text", "t"])
    assert rc == 2
    assert "error" in capsys.readouterr().err
    rc = main(["synth", "x", "-o", str(tmp_path / "a.wav"), "--model", str(tmp_path / "missing")])
    assert rc == 2


def test_synth_defaults_cap_random_weights_at_the_expected_duration(tmp_path, capsys):
    """No --max-frames: random weights never emit EOS, so the cap is the text's expected
    speech duration (not 28 s of noise); progress goes to stderr, the summary to stdout."""
    import math

    from rtvoice.segmenter import estimate_speech_seconds
    from rtvoice.synth import default_max_frames

    out = tmp_path / "auto.wav"
    assert main(["synth", "Hello world.", "-o", str(out)]) == 0
    want = math.ceil(estimate_speech_seconds("Hello world.") * 44100 / 2048)
    assert default_max_frames("Hello world.", 44100 / 2048, random_weights=True) == want
    assert sf.info(str(out)).frames == want * 2048
    cap = capsys.readouterr()
    assert f"{want}/{want} frames" in cap.err and "random weights" in cap.err
    assert "wrote" in cap.out and "frame cap" in cap.out
    # a real checkpoint gets the server's segment budget: 3x the duration, at least 32
    assert default_max_frames("Hello world.", 44100 / 2048, random_weights=False) == max(
        32, math.ceil(estimate_speech_seconds("Hello world.") * 3 * 44100 / 2048))
    assert default_max_frames("word " * 10_000, 21.5, random_weights=True) == 2048


def test_synth_checks_the_output_before_synthesising(tmp_path, capsys, monkeypatch):
    import rtvoice.synth as synth

    def boom(*a, **k):
        raise AssertionError("the model must not load for a bad output path")

    monkeypatch.setattr(synth, "load_bundle", boom)
    existing = tmp_path / "taken.wav"
    existing.write_bytes(b"keep me")
    for argv, words in (
        (["-o", str(existing)], "exists; pass --overwrite"),
        (["-o", str(tmp_path / "missing" / "a.wav")], "does not exist"),
        (["-o", str(tmp_path)], "is a directory"),
    ):
        capsys.readouterr()
        assert main(["synth", "Hi.", *argv]) == 2
        assert words in capsys.readouterr().err
    assert existing.read_bytes() == b"keep me"


def test_synth_overwrite_and_quiet(tmp_path, capsys):
    out = tmp_path / "o.wav"
    out.write_bytes(b"old")
    assert main(["synth", "Hi.", "-o", str(out), "--overwrite", "--max-frames", "2", "-q"]) == 0
    assert sf.info(str(out)).frames == 2 * 2048
    cap = capsys.readouterr()
    assert "synth:" not in cap.err and "wrote" in cap.out
    assert not list(tmp_path.glob(".*partial"))


def test_synth_help_documents_every_option(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["synth", "--help"])
    text = capsys.readouterr().out
    for opt in ("--output", "--overwrite", "--model", "--device", "--reference",
                "--reference-text", "--seed", "--max-frames", "--temperature", "--top-p",
                "--top-k", "--quiet"):
        assert opt in text
    assert text.count("default") >= 11 and "synth.wav" in text
