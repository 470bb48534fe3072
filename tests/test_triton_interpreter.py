"""The Triton kernels on the CPU: the `interp` tests of tests/test_fp8_triton.py,
tests/test_codec_conv.py and tests/test_decode_attention_triton.py (the FP8 GEMMs, the codec's
fused conv, residual unit and transposed convs against their float64 references, the paged
decode attention against its float32 fallback, with shared prefixes also as the real engine
plans them) under Triton's interpreter, and
tests/test_triton_sm90.py (the kernels no GPU has run yet compiled for sm_90), in a venv of
their own.

Triton's interpreter needs triton, which the project's CPU environment does not install, and
numpy < 2 (Triton 3.5's interpreter turns one-element arrays into ints with `int()`, an error
under numpy 2), which the project does not pin; so they run in a venv built here once
(`RTVOICE_TRITON_VENV`, default ~/.cache/rtvoice/triton-interp) with the pins below, and this
test fails if any of them fails or fewer run than the files hold.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# safetensors: the engine's loader (the shared-prefix test drives the real engine)
PINS = ("torch==2.13.0", "triton==3.5.0", "numpy<2", "pytest>=8", "safetensors>=0.4")
FILES = ("tests/test_fp8_triton.py", "tests/test_codec_conv.py",
         "tests/test_decode_attention_triton.py")


def _venv() -> Path:
    """The venv's python, built (or rebuilt when the pins change) on first use."""
    root = Path(os.environ.get("RTVOICE_TRITON_VENV",
                               Path.home() / ".cache" / "rtvoice" / "triton-interp"))
    py = root / "bin" / "python"
    stamp = root / "pins.txt"
    want = "\n".join(PINS) + f"\n{sys.version_info[:2]}\n"
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True,
                   timeout=300)
    # the CPU build of torch first (the pins name it), as scripts/test.sh installs it
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (f"could not build the Triton interpreter venv at {root} "
                               f"(pip install {' '.join(PINS)}):\n{r.stdout[-2000:]}"
                               f"\n{r.stderr[-2000:]}")
    stamp.write_text(want)
    return py


def _interp_tests() -> int:
    """How many tests of FILES carry `interp` in their name (parametrisations counted by the
    collection below): the bound the run must reach."""
    text = "".join((ROOT / f).read_text() for f in FILES)
    return len(re.findall(r"^def test_interp_\w+", text, flags=re.M))


@pytest.mark.timeout(1800)
def test_triton_kernels_under_the_interpreter():
    py = _venv()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT),
           "PYTHONHASHSEED": "0"}
    r = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                        "interp", *FILES], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, f"interpreter tests failed:\n{tail}"
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and "skipped" not in r.stdout.splitlines()[-1], tail
    # every interp test function ran, at least once each (most are parametrised)
    assert int(passed.group(1)) >= _interp_tests() > 0, tail
    print(f"triton interpreter: {passed.group(0)}")


@pytest.mark.timeout(1800)
def test_triton_kernels_compile_for_sm90():
    """tests/test_triton_sm90.py in the same venv, compiled (not interpreted): the kernels no
    GPU has run yet lowered for sm_90 through Triton's bundled ptxas."""
    py = _venv()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    r = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_triton_sm90.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1500)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, f"sm_90 compile tests failed:\n{tail}"
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and "skipped" not in r.stdout.splitlines()[-1], tail
    text = (ROOT / "tests/test_triton_sm90.py").read_text()
    assert int(passed.group(1)) >= len(re.findall(r"^def test_sm90_\w+", text, flags=re.M)) > 0
    print(f"triton sm_90 compiles: {passed.group(0)}")
