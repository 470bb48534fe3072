"""`rtvoice inspect`: a clean report on the fixture set (as a directory and as a Hub model id
in a local Hub cache), and every problem of a broken copy named, with exit status 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.inspect_checkpoint import inspect_checkpoint


def _rtvoice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "rtvoice.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_fixture_set_reports_clean(fixture_dir: Path) -> None:
    proc = _rtvoice("inspect", str(fixture_dir))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "problems: none, it loads" in out
    assert "38 of 38 tensors, 7,640,512 parameters (config.json implies 7,640,512" in out
    assert "<|im_end|> 514" in out and "semantic:0..4095|> 547..4642" in out
    assert "loaded: 302 tensors" in out and "missing: 0, mis-shaped: 0" in out
    assert "GPU memory (estimate)" in out and "FP8" in out


def _hub_cache(root: Path, fixture_dir: Path, repo: str = "fishaudio/s2-tiny") -> Path:
    """A Hub cache laid out as huggingface_hub writes it, from the fixture set."""
    models = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(fixture_dir, models / "snapshots" / commit)
    (models / "refs").mkdir(parents=True)
    (models / "refs" / "main").write_text(commit)
    return root


def test_hub_model_id_resolves_offline_in_the_local_cache(tmp_path: Path, fixture_dir: Path,
                                                          monkeypatch) -> None:
    from engine.hub import resolve_local
    from engine.loader import load_bundle

    cache = _hub_cache(tmp_path / "hub", fixture_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never ask the Hub from a test
    snap = resolve_local("fishaudio/s2-tiny")
    assert snap.name.startswith("0123456789") and (snap / "config.json").is_file()
    assert resolve_local("fishaudio/s2-tiny@0123456789abcdef0123456789abcdef01234567") == snap
    with pytest.raises(FileNotFoundError, match=r"not in the local Hub cache.*hf download"):
        resolve_local("fishaudio/s2-tiny@v2")
    with pytest.raises(FileNotFoundError, match="not in the local Hub cache"):
        resolve_local("someone/else")
    report = inspect_checkpoint("fishaudio/s2-tiny")
    assert not report.problems and "Hub id fishaudio/s2-tiny" in report.text()
    bundle = load_bundle("fishaudio/s2-tiny")  # the server's --model takes it too
    assert bundle.name == "fishaudio/s2-tiny" and not bundle.random_weights
    proc = _rtvoice("inspect", "fishaudio/s2-tiny",
                    env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "problems: none" in proc.stdout


def test_a_broken_copy_names_each_problem(tmp_path: Path, fixture_dir: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(fixture_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["text_model.model.norm.weight"]  # missing
    weights["text_model.model.layers.0.ffn_norm.weight"] = torch.ones(7)  # mis-shaped
    weights["text_model.model.bogus.weight"] = torch.ones(2)  # unexpected
    save_file(weights, str(broken / "model.safetensors"))
    codec = load_file(str(broken / "codec.safetensors"))
    del codec["decoder.model.0.conv.bias"]
    codec["quantizer.post_module.norm.weight"] = torch.ones(63)
    codec["decoder.extra.weight"] = torch.zeros(3)  # skipped with a warning: not a problem
    save_file(codec, str(broken / "codec.safetensors"))
    (broken / "tokenizer.json").write_text("{not json")
    proc = _rtvoice("inspect", str(broken))
    out = proc.stdout
    assert proc.returncode == 1, out
    problems = out.split("problems:")[1]
    assert "missing model tensors: text_model.model.norm.weight" in problems
    assert "text_model.model.layers.0.ffn_norm.weight: [7] in the checkpoint, config.json " \
           "implies [128]" in problems
    assert "unexpected model tensors" in problems and "text_model.model.bogus.weight" in problems
    assert "missing codec tensor 'decoder.model.0.conv.bias'" in problems
    assert "'quantizer.post_module.norm.weight' has shape [63]" in problems and "[64]" in problems
    assert "tokenizer.json" in problems
    assert "decoder.extra.weight" in out.split("problems:")[0]  # listed as ignored
    # no config at all, or not a checkpoint
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    report = inspect_checkpoint(str(broken))
    assert any("unsupported model_type 'llama'" in p for p in report.problems)
    report = inspect_checkpoint(str(tmp_path / "nowhere"))
    assert report.problems and "nor a Hub model id" in report.problems[0]
