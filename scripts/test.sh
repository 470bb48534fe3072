#!/usr/bin/env bash
# The test command (README command two; .ci/run calls it). Installs everything the suite
# needs from the project's own files, then runs ruff and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages (needs root, else those tests are skipped): headless Chromium for the
# browser-demo test, nginx for the load-balancer test in front of two replicas.
need=()
command -v chromedriver >/dev/null || need+=(chromium chromium-driver)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ ${#need[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${need[@]}" >/dev/null) \
        || echo "warning: could not install ${need[*]}; the tests needing them will be skipped"
fi
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA wheel.
python3 -m pip install -q torch==2.13.0 -e '.[dev]'
python3 -m ruff check .
python3 -m pytest -q "$@"
