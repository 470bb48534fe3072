"""Model ids of the Hugging Face Hub (`org/name[@revision]`) resolved in the local Hub cache,
offline: the same layout `huggingface_hub` writes (`models--org--name/refs/<rev>` naming a
commit, `snapshots/<commit>/` holding the files), found where it looks for it
($HF_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["hub_cache", "parse_repo_id", "resolve_local"]

_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


def parse_repo_id(spec: str) -> tuple[str, str] | None:
    """'org/name[@revision]' -> (repo id, revision; 'main' by default); None when `spec` is not
    shaped like a Hub id."""
    m = _REPO_ID.match(spec)
    if m is None or spec.startswith((".", "/")) or ".." in spec:
        return None
    return m.group("repo"), m.group("rev") or "main"


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories on this machine."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "huggingface" / "hub"


def resolve_local(spec: str) -> Path:
    """The snapshot directory of a Hub model id in the local cache. Raises FileNotFoundError
    saying where it looked and how to get the files."""
    parsed = parse_repo_id(spec)
    if parsed is None:
        raise FileNotFoundError(f"{spec!r} is not a directory nor a Hub model id (org/name[@rev])")
    repo, rev = parsed
    root = hub_cache() / f"models--{repo.replace('/', '--')}"
    commit = rev
    ref = root / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
    snapshot = root / "snapshots" / commit
    if not snapshot.is_dir():
        have = sorted(p.name for p in (root / "snapshots").glob("*")) if root.is_dir() else []
        raise FileNotFoundError(
            f"{repo}@{rev} is not in the local Hub cache ({root}"
            + (f"; it holds revisions {', '.join(have)}" if have else "")
            + f"): download it first, e.g. `huggingface-cli download {repo}"
            + (f" --revision {rev}" if rev != "main" else "") + "`, or pass its directory")
    return snapshot
