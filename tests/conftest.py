from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _paths import FIXTURES


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The reference fixture set (tests/_paths.py says where it is looked for)."""
    if not (FIXTURES / "config.json").is_file():
        msg = f"reference fixtures not found at {FIXTURES} (set RTVOICE_FIXTURES)"
        if os.environ.get("CI"):  # CI must prove exactness, not skip it
            pytest.fail(msg)
        pytest.skip(msg)
    return FIXTURES


@pytest.fixture(scope="session")
def fixture_model(fixture_dir):
    from engine.weights import load_model

    torch.set_num_threads(1)
    return load_model(fixture_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_bundle():
    from engine.loader import load_bundle

    return load_bundle("tiny", device="cpu", max_seq_len=1024)
