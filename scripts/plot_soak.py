"""Plot the server RSS of soak runs (tests/test_soak.py with RTVOICE_SOAK_OUT=run.json).

    python scripts/plot_soak.py OUT.png LABEL=run1.json LABEL=run2.json ...
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__)
        return 2
    fig, ax = plt.subplots(figsize=(8, 4))
    for arg in argv[1:]:
        label, path = arg.split("=", 1)
        run = json.load(open(path))
        t, mb = zip(*run["rss"])
        ax.plot(t, mb, label=f"{label}: {run['sessions']} sessions, {run['turns']} turns")
    ax.set_xlabel("seconds into the soak (56 concurrent sessions, tiny model, 2-core CPU)")
    ax.set_ylabel("server RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(argv[0], dpi=120)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
