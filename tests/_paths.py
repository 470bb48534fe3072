"""Where the reference fixture set is: $RTVOICE_FIXTURES (the set, or the folder holding
fish_s2_tiny), else tests/fixtures/fish_s2_tiny, shipped in the repository.

A test that needs the set calls ``require_fixtures()`` (or takes conftest's ``fixture_dir``):
it skips when the set is missing, except under CI (``CI`` set; ``.ci/run`` sets it), where it
fails — CI must prove exactness, not skip it."""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "fixtures" / "fish_s2_tiny"

# What the reference tests read; a set missing any of them is not usable.
FIXTURE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "codec.safetensors",
                 "codec_cases.safetensors")


def fixture_set() -> Path:
    env = os.environ.get("RTVOICE_FIXTURES")
    if env:
        p = Path(env)
        return p / "fish_s2_tiny" if (p / "fish_s2_tiny").is_dir() else p
    return SHIPPED


FIXTURES = fixture_set()


def fixtures_missing(root: Path = FIXTURES) -> list[str]:
    return [f for f in FIXTURE_FILES if not (root / f).is_file()]


def require_fixtures(root: Path = FIXTURES) -> Path:
    """``root`` if the set is complete; else skip the test, or fail it under CI."""
    import pytest

    missing = fixtures_missing(root)
    if missing:
        where = ("from RTVOICE_FIXTURES" if os.environ.get("RTVOICE_FIXTURES")
                 else "shipped in the repository: restore tests/fixtures")
        msg = f"reference fixtures incomplete at {root} ({where}): missing {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return root
