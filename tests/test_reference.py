"""The reference fixtures, through the same entry point users run."""

from __future__ import annotations

from engine import verify_reference


def test_verify_reference_model_and_codec(fixture_dir, capsys):
    rc = verify_reference.main([str(fixture_dir), "--codec-chunk", "1", "--codec-chunk", "3",
                                "--codec-chunk", "7"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out
    assert "d_two_turns.b1.generated" in out and "decode.audio" in out


def test_verify_reference_fails_on_a_broken_set(tmp_path, fixture_dir, capsys):
    import shutil

    broken = tmp_path / "set"
    shutil.copytree(fixture_dir, broken)
    # Corrupt one generated frame: the greedy check must catch it.
    from safetensors.torch import load_file, save_file

    f = broken / "cases" / "a_text_en.safetensors"
    t = load_file(str(f))
    t["b0.generated"][3, 5] += 1
    save_file(t, str(f))
    rc = verify_reference.main([str(broken), "--skip-codec"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  a_text_en.b0.generated" in out


def test_verify_reference_bad_dir(tmp_path):
    assert verify_reference.main([str(tmp_path / "nope")]) == 2
