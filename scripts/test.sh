#!/usr/bin/env bash
# The test command (README command two; .ci/run calls it). Installs everything the suite
# needs from the project's own files, then runs ruff and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless Chromium for the browser-demo test (Debian packages; needs root, else skipped).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium chromium-driver >/dev/null) || echo "warning: chromium not installed; the browser test will be skipped"
fi
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA wheel.
python3 -m pip install -q torch==2.13.0 -e '.[dev]'
python3 -m ruff check .
python3 -m pytest -q "$@"
