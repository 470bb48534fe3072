"""Where the reference fixture set is: $RTVOICE_FIXTURES (the set, or the folder holding
fish_s2_tiny), else ../shared/fixtures/fish_s2_tiny beside the checkout."""

from __future__ import annotations

import os
from pathlib import Path


def fixture_set() -> Path:
    env = os.environ.get("RTVOICE_FIXTURES")
    if env:
        p = Path(env)
        return p / "fish_s2_tiny" if (p / "fish_s2_tiny").is_dir() else p
    return Path(__file__).resolve().parents[2] / "shared/fixtures/fish_s2_tiny"


FIXTURES = fixture_set()
