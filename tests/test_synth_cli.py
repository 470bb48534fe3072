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
