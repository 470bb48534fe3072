#!/usr/bin/env bash
# The service's Python packages that the lent GPU machine lacks, as wheels for its Python
# (3.12, manylinux x86_64), into .whl/ (git-ignored). Carry .whl to the device
# (`carry: [".whl"]`); scripts/gpu_all.sh installs them there into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
# the versions this machine runs (the device has torch, numpy, h11, anyio, click, uvloop...)
for pkg in msgspec starlette uvicorn websockets soundfile soxr python-multipart httptools \
           pytest-asyncio cffi pycparser; do
    version=$(python3 -c "import importlib.metadata as m; print(m.version('$pkg'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "$pkg==$version"
done
ls .whl
