"""``python -m bench_latency`` = ``bench-latency``."""

from .cli import main

raise SystemExit(main())
