from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _paths import FIXTURES, fixtures_missing, require_fixtures


def pytest_report_header(config: pytest.Config) -> str:
    missing = fixtures_missing()
    if not missing:
        return f"reference fixtures: {FIXTURES}"
    return (f"reference fixtures: MISSING at {FIXTURES} ({', '.join(missing)}): the tests "
            f"needing them {'FAIL (CI is set)' if os.environ.get('CI') else 'are SKIPPED'}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    missing = fixtures_missing()
    if missing:
        terminalreporter.write_line(
            f"WARNING: reference fixtures missing at {FIXTURES} ({', '.join(missing)}); the "
            "exactness tests did not run. Restore tests/fixtures or set RTVOICE_FIXTURES.",
            yellow=True, bold=True)


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The reference fixture set (tests/_paths.py says where it is looked for)."""
    return require_fixtures()


@pytest.fixture(scope="session")
def fixture_model(fixture_dir):
    from engine.weights import load_model

    torch.set_num_threads(1)
    return load_model(fixture_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_bundle():
    from engine.loader import load_bundle

    return load_bundle("tiny", device="cpu", max_seq_len=1024)
