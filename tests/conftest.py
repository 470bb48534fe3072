from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _paths import FIXTURES


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The reference fixture set (tests/_paths.py says where it is looked for)."""
    if not (FIXTURES / "config.json").is_file():
        pytest.skip(f"reference fixtures not found at {FIXTURES} (set RTVOICE_FIXTURES)")
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
