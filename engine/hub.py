"""Models by Hub id: `--model org/name[@revision]` (a branch, tag or commit hash; `main` by
default) resolved through `huggingface_hub` into a snapshot directory of its cache.

- Only the files a checkpoint needs are fetched (`CHECKPOINT_FILES`), with huggingface_hub's
  own progress bars; the log says which repo and revision is fetched and where it landed.
- The token is huggingface_hub's (`HF_TOKEN`, or `hf auth login`): this module never reads
  nor logs its value, and scrubs it from any message it passes on.
- Offline (`HF_HUB_OFFLINE=1`), or when the Hub cannot be reached (the log says so), the
  snapshot comes from the local cache; not there -> FileNotFoundError naming the repo, the
  revision, the cache and the command that downloads it. Gated, private, missing repos and
  revisions -> `HubError` (a FileNotFoundError) saying what to do.
- The cache is where huggingface_hub looks ($HF_HUB_CACHE, $HF_HOME/hub,
  $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub), read when a model is resolved
  (huggingface_hub reads it once, at import) and passed to it explicitly; HF_HUB_OFFLINE too.

A string naming an existing local directory is a directory, never a Hub id (engine/loader.py
checks that first); `tiny` and `s2-pro` are presets.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

__all__ = ["CHECKPOINT_FILES", "HubError", "hub_cache", "is_offline", "parse_repo_id",
           "resolve", "resolve_local"]

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")

# What engine/loader.py reads from a checkpoint (config.py, weights.py, tokenizer.py,
# codec/weights.py), plus the small tokenizer side files: nothing else of a repo is fetched.
CHECKPOINT_FILES = [
    "config.json",
    "model*.safetensors",  # model.safetensors or model-0000i-of-0000n.safetensors
    "model*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "codec.pth",
    "codec.safetensors",
    "codec_config.json",
]

_TRUE = {"1", "on", "yes", "true"}
# Transport failures (httpx, httpx2, requests, urllib3 class names): the Hub is unreachable.
_UNREACHABLE = {"ConnectError", "ConnectTimeout", "ConnectionError", "TimeoutException", "Timeout",
                "ReadTimeout", "NetworkError", "TransportError", "ProxyError", "RemoteProtocolError",
                "NewConnectionError", "MaxRetryError", "OfflineModeIsEnabled"}


class HubError(FileNotFoundError):
    """A Hub model id that cannot be resolved: the message says why and what to do."""


def parse_repo_id(spec: str) -> tuple[str, str] | None:
    """'org/name[@revision]' -> (repo id, revision; 'main' by default); None when `spec` is not
    shaped like a Hub id."""
    m = _REPO_ID.match(spec)
    if m is None or spec.startswith((".", "/")) or ".." in spec:
        return None
    return m.group("repo"), m.group("rev") or "main"


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories on this machine (read now)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "huggingface" / "hub"


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as the environment says now; unset: what
    huggingface_hub read at import (or was set to since)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var):
            return os.environ[var].strip().lower() in _TRUE
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _scrub(text: str) -> str:
    """`text` without the token's value (huggingface_hub's messages never hold it; this makes
    sure ours do not either)."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        token = os.environ.get(var, "").strip()
        if len(token) >= 4:
            text = text.replace(token, "***")
    return text


def _why(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return _scrub(f"{type(e).__name__}: {first}" if first else type(e).__name__)


def _download_hint(repo: str, rev: str) -> str:
    """The command that fetches the checkpoint files (only them) into the cache."""
    from huggingface_hub import __version__

    major, minor = (int(x) for x in re.findall(r"\d+", __version__)[:2])
    revision = f" --revision {rev}" if rev != "main" else ""
    include = "--include '*.json' --include 'model*.safetensors' --include 'codec.*'"
    if (major, minor) < (0, 34):  # the `hf` command came with 0.34
        return f"`huggingface-cli download {repo}{revision} {include.replace(' --include', '')}`"
    return f"`hf download {repo}{revision} {include}`"


def _held(root: Path) -> str:
    refs = sorted(str(p.relative_to(root / "refs")) for p in (root / "refs").rglob("*")
                  if p.is_file()) if (root / "refs").is_dir() else []
    snaps = sorted(p.name for p in (root / "snapshots").glob("*")) if root.is_dir() else []
    held = ([f"refs {', '.join(refs)}"] if refs else []) + (
        [f"snapshots {', '.join(snaps)}"] if snaps else [])
    return f"; it holds {'; '.join(held)}" if held else ""


def _not_cached(repo: str, rev: str, cache: Path, why: str) -> HubError:
    root = cache / f"models--{repo.replace('/', '--')}"
    return HubError(
        f"{repo}@{rev} is not in the local Hub cache ({root}{_held(root)}) and {why}: download "
        f"it first, e.g. {_download_hint(repo, rev)}, or pass its directory")


def resolve_local(spec: str, *, why: str = "this lookup is offline") -> Path:
    """The snapshot directory of a Hub model id in the local cache, never touching the network
    (huggingface_hub with local_files_only). Raises HubError (a FileNotFoundError) saying
    where it looked and how to get the files."""
    parsed = parse_repo_id(spec)
    if parsed is None:
        raise HubError(f"{spec!r} is not a directory nor a Hub model id (org/name[@revision])")
    repo, rev = parsed
    from huggingface_hub import snapshot_download

    cache = hub_cache()
    try:
        path = Path(snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=True,
                                      allow_patterns=CHECKPOINT_FILES))
    except ValueError as e:  # HFValidationError: not a valid repo id
        raise HubError(f"{spec!r} is not a valid Hub model id: {_why(e)}") from None
    except FileNotFoundError as e:  # LocalEntryNotFoundError, IncompleteSnapshotError
        if type(e).__name__ == "IncompleteSnapshotError":
            raise HubError(f"{repo}@{rev}: the cached snapshot is incomplete ({_why(e)}); "
                           f"download it again, e.g. {_download_hint(repo, rev)}") from None
        raise _not_cached(repo, rev, cache, why) from None
    return path


def _status(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def _unreachable(e: BaseException) -> bool:
    from huggingface_hub.utils import HfHubHTTPError

    if isinstance(e, HfHubHTTPError):  # an answer from the Hub: unreachable only when it is down
        return (_status(e) or 0) >= 500
    return any(c.__name__ in _UNREACHABLE for c in type(e).__mro__) or isinstance(e, TimeoutError)


def _hub_error(repo: str, rev: str, e: BaseException) -> HubError:
    """What a Hub refusal means and what to do about it."""
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = f"https://huggingface.co/{repo}"
    token = ("HF_TOKEN is set: check that it is valid and has read access to this repo" if
             os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") else
             "set HF_TOKEN to an access token of your account (https://huggingface.co/settings/"
             "tokens) or run `hf auth login`")
    local = "" if Path(repo).is_dir() else f" (and there is no local directory {repo!r})"
    if isinstance(e, GatedRepoError):
        msg = (f"{repo} is a gated model: accept its conditions at {url} while logged in, "
               f"then {token}")
    elif isinstance(e, RevisionNotFoundError):
        msg = (f"{repo} has no revision {rev!r}: pass a branch, tag or commit hash of it, e.g. "
               f"{repo}@main (see {url}/tree/main)")
    elif isinstance(e, RepositoryNotFoundError):
        msg = (f"{repo} is not a model repository on the Hub{local}, or it is private: check "
               f"the id; for a private repo, {token}")
    elif isinstance(e, HfHubHTTPError) and _status(e) in (401, 403):
        msg = f"the Hub refused access to {repo} (HTTP {_status(e)}): {token}"
    else:
        msg = f"fetching {repo}@{rev} from the Hub failed"
    return HubError(f"{msg} [{_why(e)}]")


def resolve(spec: str) -> Path:
    """The snapshot directory of `org/name[@revision]`: fetched through huggingface_hub (only
    CHECKPOINT_FILES, with its progress bars), or from the local cache when offline or when the
    Hub cannot be reached. Raises HubError (a FileNotFoundError) saying what to do."""
    parsed = parse_repo_id(spec)
    if parsed is None:
        raise HubError(f"{spec!r} is not a directory nor a Hub model id (org/name[@revision])")
    repo, rev = parsed
    cache = hub_cache()
    if is_offline():
        path = resolve_local(spec, why="HF_HUB_OFFLINE is set (unset it to fetch it)")
        log.info("model %s@%s: offline (HF_HUB_OFFLINE), from the local Hub cache: %s",
                 repo, rev, path)
        return path

    import huggingface_hub

    try:
        # One small call first, so that an unreachable Hub is told apart (snapshot_download
        # would silently fall back to the cache) and refusals get their own message.
        huggingface_hub.repo_info(repo, revision=rev, timeout=10)
    except Exception as e:  # sorted out below
        if _unreachable(e):
            return _fallback(spec, repo, rev, e)
        return _refused(spec, repo, rev, e)
    auth = ("token: HF_TOKEN" if os.environ.get("HF_TOKEN") or os.environ.get(
        "HUGGING_FACE_HUB_TOKEN") else "no HF_TOKEN: anonymous unless `hf auth login` was run")
    log.info("model %s@%s: fetching the checkpoint files (%s) from the Hub into %s (%s)",
             repo, rev, ", ".join(CHECKPOINT_FILES), cache, auth)
    try:
        path = Path(huggingface_hub.snapshot_download(
            repo, revision=rev, cache_dir=cache, allow_patterns=CHECKPOINT_FILES))
    except Exception as e:  # sorted out below
        if _unreachable(e) or isinstance(e, FileNotFoundError):  # lost on the way
            return _fallback(spec, repo, rev, e)
        return _refused(spec, repo, rev, e)
    log.info("model %s@%s: commit %s at %s", repo, rev, path.name, path)
    return path


def _fallback(spec: str, repo: str, rev: str, e: BaseException) -> Path:
    why = f"the Hub cannot be reached ({_why(e)})"
    if isinstance(e, FileNotFoundError) and not _unreachable(e):
        why = f"fetching it failed ({_why(e)})"
    log.warning("model %s@%s: %s; using the local Hub cache", repo, rev, why)
    path = resolve_local(spec, why=why)
    log.info("model %s@%s: from the local Hub cache: %s", repo, rev, path)
    return path


def _refused(spec: str, repo: str, rev: str, e: BaseException) -> Path:
    """The Hub said no (missing, private, gated, no such revision, bad id): a revision other
    than a missing one may still be in the cache (a token that expired); else say what to do."""
    from huggingface_hub.utils import HfHubHTTPError, RevisionNotFoundError

    if isinstance(e, ValueError):  # HFValidationError
        raise HubError(f"{spec!r} is not a valid Hub model id: {_why(e)}") from None
    if not isinstance(e, HfHubHTTPError):
        raise e
    err = _hub_error(repo, rev, e)
    if not isinstance(e, RevisionNotFoundError):
        try:
            path = resolve_local(spec)
        except FileNotFoundError:
            pass
        else:
            log.warning("model %s@%s: %s; using the copy in the local Hub cache: %s",
                        repo, rev, err, path)
            return path
    raise err from None
