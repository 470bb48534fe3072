"""`--model org/name[@revision]` through huggingface_hub (engine/hub.py): offline against a Hub
cache laid out exactly as huggingface_hub writes it (blobs/, snapshots/<commit>/ symlinks into
them, refs/<branch or tag>), built from the fixture set; the online path with huggingface_hub's
network calls replaced (no network): what is fetched, which revision, the fallback when the Hub
cannot be reached, the messages for refused access, and the token never in a log or message.

Every environment variable is set with monkeypatch; huggingface_hub reads HF_HUB_OFFLINE and
the cache path once, at import (huggingface_hub.constants): engine/hub.py reads both when it
resolves and passes them on, and the tests check that the import-time values do not matter.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    filter_repo_objects,
)

from engine import hub
from engine.hub import CHECKPOINT_FILES, HubError, parse_repo_id, resolve, resolve_local

REPO = "fishaudio/s2-tiny"
OLD = "0123456789abcdef0123456789abcdef01234567"  # tagged v1.0
NEW = "89abcdef0123456789abcdef0123456789abcdef"  # main
SECRET = "hf_SeCrEtT0kenValue0123456789abcdef"


def _blob_name(data: bytes, lfs: bool) -> str:
    """huggingface_hub names a blob by its LFS sha256, or by its git blob sha1."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def build_hub_cache(cache: Path, fixture_dir: Path, repo: str = REPO) -> Path:
    """models--org--name/{blobs,snapshots,refs} as huggingface_hub lays them out: each file of
    a snapshot a relative symlink to its blob (a copy where symlinks are not possible), refs
    holding the commit without a newline. Two commits: main -> NEW, tag v1.0 -> OLD."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    files = sorted(p for p in fixture_dir.iterdir() if p.is_file())
    for commit in (OLD, NEW):
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in files:
            data = f.read_bytes()
            blob = root / "blobs" / _blob_name(data, f.suffix in (".safetensors", ".pth"))
            if not blob.exists():
                blob.write_bytes(data)
            try:
                (snap / f.name).symlink_to(os.path.relpath(blob, snap))
            except OSError:
                shutil.copyfile(blob, snap / f.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(NEW)
    (root / "refs" / "v1.0").write_text(OLD)
    return cache


@pytest.fixture(scope="module")
def cache(fixture_dir: Path, tmp_path_factory) -> Path:
    return build_hub_cache(tmp_path_factory.mktemp("hf") / "hub", fixture_dir)


@pytest.fixture
def env(cache: Path, monkeypatch, tmp_path: Path) -> Path:
    """Offline, on the fixture cache, with huggingface_hub's import-time constants pointing
    elsewhere (they must not matter), and no network call allowed."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "not-this-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(*args, **kwargs):
        raise AssertionError("offline: no call to the Hub")

    monkeypatch.setattr(huggingface_hub, "repo_info", no_network)
    return cache


def _snap(cache: Path, commit: str) -> Path:
    return cache.resolve() / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


# -- offline -------------------------------------------------------------------------------


def test_parse_repo_id() -> None:
    assert parse_repo_id("org/name") == ("org/name", "main")
    assert parse_repo_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_repo_id(f"org/name@{OLD}") == ("org/name", OLD)
    assert parse_repo_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for spec in ("tiny", "s2-pro", "./org/name", "/abs/dir", "../x/y", "a/b/c", "~/x", ""):
        assert parse_repo_id(spec) is None, spec


@pytest.mark.parametrize(("spec", "commit"), [
    (REPO, NEW), (f"{REPO}@main", NEW), (f"{REPO}@{OLD}", OLD), (f"{REPO}@{NEW}", NEW),
    (f"{REPO}@v1.0", OLD),
])
def test_offline_resolution_by_id_branch_commit_and_tag(env: Path, spec: str, commit: str,
                                                        caplog) -> None:
    caplog.set_level(logging.INFO, logger="engine.hub")
    path = resolve(spec)
    assert path == _snap(env, commit)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_symlink()
    assert "offline" in caplog.text and str(path) in caplog.text
    assert resolve_local(spec) == path


def test_offline_missing_revision_or_repo_is_a_clear_error(env: Path) -> None:
    root = env / "models--fishaudio--s2-tiny"
    with pytest.raises(FileNotFoundError) as e:
        resolve(f"{REPO}@v9")
    msg = str(e.value)
    assert isinstance(e.value, HubError)
    assert f"{REPO}@v9 is not in the local Hub cache ({root}" in msg
    assert "HF_HUB_OFFLINE" in msg and f"`hf download {REPO} --revision v9 --include '*.json'" in msg
    assert "refs main, v1.0" in msg and OLD in msg  # what it does hold
    with pytest.raises(HubError) as e:
        resolve("someone/else")
    msg = str(e.value)
    assert "someone/else@main is not in the local Hub cache" in msg
    assert str(env / "models--someone--else") in msg and "`hf download someone/else --include" in msg
    with pytest.raises(HubError, match="not a valid Hub model id"):
        resolve("some--one/else")


def test_an_incomplete_cached_snapshot_is_named(env: Path, tmp_path: Path, monkeypatch) -> None:
    """huggingface_hub >= 1 keeps the repo's file list per commit (trees/<commit>.json): a
    snapshot missing a checkpoint file is refused rather than half-loaded."""
    from huggingface_hub import _snapshot_download as sd

    if not hasattr(sd, "write_tree_cache"):
        pytest.skip("this huggingface_hub keeps no tree listing")
    cache = tmp_path / "hub"
    shutil.copytree(env, cache, symlinks=True)
    root = cache / "models--fishaudio--s2-tiny"
    entries = {p.name: sd.TreeCacheEntry(size=p.stat().st_size, blob_id="0" * 40, lfs_sha256=None,
                                         lfs_size=None, xet_hash=None)
               for p in (root / "snapshots" / NEW).iterdir()}
    sd.write_tree_cache(str(root), NEW, entries)
    (root / "snapshots" / NEW / "tokenizer.json").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(HubError, match=r"snapshot is incomplete.*tokenizer\.json"):
        resolve(REPO)
    assert resolve(f"{REPO}@v1.0").name == OLD


def test_env_is_read_when_resolving_not_at_import(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not hub.is_offline()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hub.is_offline()  # unset: what huggingface_hub holds
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert hub.is_offline()
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    assert not hub.is_offline()
    assert hub.hub_cache() == env
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", "/somewhere/hf")
    assert hub.hub_cache() == Path("/somewhere/hf/hub")


def test_the_model_loads_and_speaks_through_the_loader(env: Path, tmp_path: Path,
                                                       fixture_dir: Path) -> None:
    import soundfile as sf
    import torch

    from engine.loader import load_bundle
    from engine.weights import load_model
    from rtvoice.synth import synthesize

    bundle = load_bundle(f"{REPO}@v1.0", max_seq_len=1024)
    assert bundle.name == f"{REPO}@v1.0" and not bundle.random_weights
    ref = load_model(fixture_dir, dtype=torch.float32).state_dict()
    got = bundle.model.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    out = tmp_path / "hub.wav"
    info = synthesize("Hello world.", out, model=REPO, max_frames=3, progress=False)
    assert not info["random_weights"] and 1 <= info["frames"] <= 3
    assert sf.info(str(out)).frames == info["frames"] * 2048


def test_rtvoice_inspect_offline_in_a_fresh_process(env: Path) -> None:
    """A new interpreter: huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE at import."""
    run_env = {**os.environ, "HF_HUB_CACHE": str(env), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "rtvoice.cli", "inspect", f"{REPO}@v1.0"],
                          capture_output=True, text=True, timeout=120, env=run_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "problems: none" in proc.stdout and OLD in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "rtvoice.cli", "inspect", f"{REPO}@nope"],
                          capture_output=True, text=True, timeout=120, env=run_env)
    assert proc.returncode == 1 and "not in the local Hub cache" in proc.stdout
    assert f"hf download {REPO} --revision nope" in proc.stdout


def test_a_local_directory_named_like_a_hub_id_wins(env: Path, tmp_path: Path, fixture_dir: Path,
                                                    monkeypatch) -> None:
    import engine.loader as loader

    def boom(spec: str) -> Path:
        raise AssertionError(f"{spec} resolved on the Hub")

    monkeypatch.setattr(loader, "resolve", boom)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(fixture_dir, tmp_path / "fishaudio" / "s2-tiny")
    assert loader.checkpoint_dir(REPO) == Path(REPO)
    bundle = loader.load_bundle(REPO, max_seq_len=1024)
    assert bundle.name == "s2-tiny" and not bundle.random_weights
    shutil.copytree(fixture_dir, tmp_path / "someone" / "else")  # not in the Hub cache at all
    assert loader.checkpoint_dir("someone/else") == Path("someone/else")
    assert loader.load_bundle("tiny").random_weights  # the presets stay presets
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        loader.checkpoint_dir("no_such_dir")


# -- online, with huggingface_hub's network calls replaced ----------------------------------


class FakeHub:
    """repo_info and snapshot_download as the Hub would answer, recording the calls; the
    local_files_only lookups go to the real snapshot_download (the fixture cache)."""

    def __init__(self, cache: Path, info_error: BaseException | None = None,
                 download_error: BaseException | None = None) -> None:
        self.cache, self.info_error, self.download_error = cache, info_error, download_error
        self.infos: list[tuple[tuple, dict]] = []
        self.downloads: list[tuple[tuple, dict]] = []
        self.real = huggingface_hub.snapshot_download

    def repo_info(self, *args, **kwargs):
        self.infos.append((args, kwargs))
        if self.info_error is not None:
            raise self.info_error
        return SimpleNamespace(sha=NEW)

    def snapshot_download(self, *args, **kwargs):
        if kwargs.get("local_files_only"):
            return self.real(*args, **kwargs)
        self.downloads.append((args, kwargs))
        if self.download_error is not None:
            raise self.download_error
        rev = kwargs.get("revision") or "main"
        return str(_snap(self.cache, OLD if rev in ("v1.0", OLD) else NEW))


@pytest.fixture
def online(env: Path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as if imported offline: ignored
    monkeypatch.setenv("HF_TOKEN", SECRET)
    caplog.set_level(logging.DEBUG)

    def install(**errors) -> FakeHub:
        fake = FakeHub(env, **errors)
        monkeypatch.setattr(huggingface_hub, "repo_info", fake.repo_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
        return fake

    return install


def _http_error(cls: type[HfHubHTTPError], status: int, message: str) -> HfHubHTTPError:
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(message, response=response)


def _connect_error() -> Exception:
    try:
        import httpx2 as httpx  # what huggingface_hub >= 1 raises through
    except ImportError:
        try:
            import httpx
        except ImportError:
            import requests

            return requests.exceptions.ConnectionError("Name or service not known")
    return httpx.ConnectError("[Errno -2] Name or service not known")


def test_online_fetches_only_checkpoint_files_at_the_revision(online, env: Path, caplog) -> None:
    fake = online()
    path = resolve(f"{REPO}@v1.0")
    assert path == _snap(env, OLD)
    assert [(a, k.get("revision")) for a, k in fake.infos] == [((REPO,), "v1.0")]
    [(args, kwargs)] = fake.downloads
    assert args == (REPO,) and kwargs["revision"] == "v1.0"
    assert Path(kwargs["cache_dir"]) == env and not kwargs.get("local_files_only")
    assert kwargs["allow_patterns"] == CHECKPOINT_FILES
    # huggingface_hub's own progress bars and token: nothing that would turn them off or
    # carry the token through our code
    assert "tqdm_class" not in kwargs and "token" not in kwargs
    repo_files = ["config.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "codec.pth",
                  "README.md", ".gitattributes", "samples/demo.wav", "original/consolidated.pth",
                  "onnx/decoder.onnx", "gguf/s2-pro-q8.gguf", "training_args.bin"]
    assert sorted(filter_repo_objects(repo_files, allow_patterns=kwargs["allow_patterns"])) == \
        sorted(repo_files[:8])
    hint = ["*.json", "model*.safetensors", "codec.*"]  # what the `hf download` hint includes
    assert set(repo_files[:8]) <= set(filter_repo_objects(repo_files, allow_patterns=hint))
    assert not {"original/consolidated.pth", "gguf/s2-pro-q8.gguf", "samples/demo.wav"} & set(
        filter_repo_objects(repo_files, allow_patterns=hint))
    assert f"{REPO}@v1.0" in caplog.text and "fetching" in caplog.text
    assert str(env) in caplog.text and str(path) in caplog.text  # where it landed
    assert SECRET not in caplog.text


def test_online_default_revision_is_main(online, env: Path) -> None:
    fake = online()
    assert resolve(REPO) == _snap(env, NEW)
    assert fake.downloads[0][1]["revision"] == "main"


@pytest.mark.parametrize("error", ["connect", "offline-mode", "hub-down"])
def test_unreachable_hub_falls_back_to_the_cache_with_a_log_line(online, env: Path, caplog,
                                                                 error: str) -> None:
    from huggingface_hub.errors import OfflineModeIsEnabled

    exc = {"connect": _connect_error(), "offline-mode": OfflineModeIsEnabled("offline"),
           "hub-down": _http_error(HfHubHTTPError, 504, "504 Gateway Timeout")}[error]
    fake = online(info_error=exc)
    assert resolve(f"{REPO}@v1.0") == _snap(env, OLD)
    assert not fake.downloads
    assert "cannot be reached" in caplog.text and "using the local Hub cache" in caplog.text
    with pytest.raises(HubError) as e:
        resolve("someone/else@dev")
    msg = str(e.value)
    assert "someone/else@dev is not in the local Hub cache" in msg and "cannot be reached" in msg
    assert "`hf download someone/else --revision dev --include" in msg and str(env) in msg
    assert SECRET not in caplog.text + msg


def test_connection_lost_while_downloading_falls_back_too(online, env: Path, caplog) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    online(download_error=LocalEntryNotFoundError("An error happened while trying to locate "
                                                  "the files on the Hub"))
    assert resolve(REPO) == _snap(env, NEW)
    assert "using the local Hub cache" in caplog.text


@pytest.mark.parametrize(("cls", "status", "needles"), [
    (GatedRepoError, 403, ["gated", "accept its conditions at https://huggingface.co/someone/else",
                           "HF_TOKEN is set"]),
    (RepositoryNotFoundError, 401, ["not a model repository on the Hub",
                                    "no local directory 'someone/else'", "private"]),
    (RevisionNotFoundError, 404, ["has no revision 'dev'", "branch, tag or commit hash"]),
    (HfHubHTTPError, 403, ["refused access", "HTTP 403", "HF_TOKEN"]),
])
def test_refusals_say_what_to_do(online, caplog, cls, status: int, needles: list[str]) -> None:
    # a message that (wrongly) held the token: it must not come out of our code
    online(info_error=_http_error(cls, status, f"{status} Client Error (Authorization: {SECRET})"))
    with pytest.raises(HubError) as e:
        resolve("someone/else@dev")
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    assert SECRET not in msg and SECRET not in caplog.text


def test_gated_files_refused_while_downloading(online, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN")
    online(download_error=_http_error(GatedRepoError, 401, "401 Client Error: gated"))
    with pytest.raises(HubError, match=r"gated.*set HF_TOKEN to an access token.*hf auth login"):
        resolve("someone/else")


def test_a_refused_repo_already_in_the_cache_still_loads(online, env: Path, caplog) -> None:
    """A token that expired, a repo made private since: the cached copy serves, with a warning;
    a revision the Hub does not have is not served from the cache."""
    online(info_error=_http_error(RepositoryNotFoundError, 401, "401 Client Error"))
    assert resolve(f"{REPO}@v1.0") == _snap(env, OLD)
    assert "using the copy in the local Hub cache" in caplog.text
    online(info_error=_http_error(RevisionNotFoundError, 404, "404 Client Error"))
    with pytest.raises(HubError, match=r"has no revision 'v1\.0'"):
        resolve(f"{REPO}@v1.0")
