"""The persistent voice store."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from rtvoice.voices import (
    DB_FILENAME,
    UnknownVoice,
    VoiceLimitError,
    VoiceStore,
    VoiceStoreConfig,
)


def _codes(frames: int = 40, seed: int = 0, dtype: type = np.int64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1024, size=(10, frames))
    codes[0] = rng.integers(0, 4096, size=frames)  # semantic row: 4096 entries
    return codes.astype(dtype)


@pytest.fixture
def store(tmp_path: Path) -> VoiceStore:
    with VoiceStore(tmp_path) as s:
        yield s


def test_add_get_list_delete(store: VoiceStore) -> None:
    codes = _codes()
    v = store.add("Alice", "Hello there.", codes, {"lang": "en"}, sample_rate=16000, duration_s=1.9)
    assert len(v.id) == 12 and v.id.replace("-", "").replace("_", "").isalnum()
    assert (v.name, v.transcript, v.info.frames, v.info.codebooks) == (
        "Alice",
        "Hello there.",
        40,
        10,
    )
    assert (v.info.sample_rate, v.info.duration_s, v.info.meta) == (16000, 1.9, {"lang": "en"})
    np.testing.assert_array_equal(v.codes, codes)

    got = store.get(v.id)
    assert got.info == v.info
    np.testing.assert_array_equal(got.codes, codes)
    assert got.codes.shape == (10, 40) and got.codes.dtype == np.int16
    assert not got.codes.flags.writeable  # shared between sessions

    w = store.add("Bob", "مرحبا بكم", _codes(seed=1), sample_rate=44100, duration_s=40 * 2048 / 44100)
    assert [i.id for i in store.list()] == [v.id, w.id]
    assert store.info(w.id).name == "Bob"
    assert store.info(w.id).duration_s == pytest.approx(40 * 2048 / 44100)
    assert len(store) == 2 and v.id in store and "nope" not in store

    store.delete(v.id)
    assert [i.id for i in store.list()] == [w.id]
    with pytest.raises(UnknownVoice):
        store.get(v.id)
    assert store.list()[0].to_dict()["name"] == "Bob"


def test_int32_codes_keep_their_dtype(store: VoiceStore) -> None:
    v = store.add("x", "t", _codes(dtype=np.int32), sample_rate=44100, duration_s=1.0)
    assert store.get(v.id).codes.dtype == np.int32


def test_unknown_id_is_named(store: VoiceStore) -> None:
    for op in (store.get, store.info, store.delete):
        with pytest.raises(UnknownVoice, match="'missing-id'") as info:
            op("missing-id")
        assert info.value.voice_id == "missing-id"
        assert isinstance(info.value, LookupError)


def test_persists_across_reopen(tmp_path: Path) -> None:
    with VoiceStore(tmp_path) as first:
        kept = first.add("kept", "one", _codes(seed=2), sample_rate=44100, duration_s=1.0)
        gone = first.add("gone", "two", _codes(seed=3), sample_rate=44100, duration_s=1.0)
        first.delete(gone.id)
    assert (tmp_path / DB_FILENAME).exists()
    with VoiceStore(tmp_path) as second:  # a "restart"
        assert [i.id for i in second.list()] == [kept.id]
        np.testing.assert_array_equal(second.get(kept.id).codes, _codes(seed=2))
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # WAL is persistent
    db.close()


def test_limits(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, VoiceStoreConfig(max_voices=2, max_frames=50, max_name_chars=5))
    store.add("a", "t", _codes(50), sample_rate=44100, duration_s=1.0)
    with pytest.raises(VoiceLimitError, match="51 frames; the limit is 50"):
        store.add("b", "t", _codes(51), sample_rate=44100, duration_s=1.0)
    with pytest.raises(VoiceLimitError, match="name"):
        store.add("toolong", "t", _codes(), sample_rate=44100, duration_s=1.0)
    store.add("b", "t", _codes(), sample_rate=44100, duration_s=1.0)
    with pytest.raises(VoiceLimitError, match="full"):
        store.add("c", "t", _codes(), sample_rate=44100, duration_s=1.0)
    assert len(store) == 2
    with pytest.raises(ValueError):
        VoiceStoreConfig(max_voices=0)


@pytest.mark.parametrize(
    ("codes", "match"),
    [
        (np.zeros((9, 5), np.int64), "shape"),
        (np.zeros((10,), np.int64), "shape"),
        (np.zeros((10, 0), np.int64), "at least one frame"),
        (np.zeros((10, 5), np.float32), "integers"),
        (np.full((10, 5), -1, np.int64), "0..32767"),
        (np.full((10, 5), 70000, np.int64), "0..32767"),
    ],
)
def test_invalid_codes(store: VoiceStore, codes: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        store.add("x", "t", codes, sample_rate=44100, duration_s=1.0)
    assert len(store) == 0


def test_invalid_transcript_and_meta(store: VoiceStore) -> None:
    with pytest.raises(ValueError, match="transcript"):
        store.add("x", "   ", _codes(), sample_rate=44100, duration_s=1.0)
    with pytest.raises(TypeError):
        store.add("x", "t", _codes(), {"not": object()}, sample_rate=44100, duration_s=1.0)
    blank = store.add("   ", "t", _codes(), sample_rate=44100, duration_s=1.0)
    assert blank.name == "voice"  # blank name gets a default
    assert len(store) == 1


def test_thread_safe_concurrent_adds(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, VoiceStoreConfig(max_voices=1000))
    ids: list[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for k in range(10):
            v = store.add(f"v{seed}-{k}", "t", _codes(8, seed), sample_rate=44100, duration_s=1.0)
            store.get(v.id)
            with lock:
                ids.append(v.id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == len(set(ids)) == 80 == len(store)


def test_refuses_newer_schema(tmp_path: Path) -> None:
    VoiceStore(tmp_path).close()
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(RuntimeError, match="schema version 99"):
        VoiceStore(tmp_path)


def test_store_opening_retries_while_another_process_holds_the_file(tmp_path, monkeypatch):
    """Found in CI: a second replica opening the shared store while the first was opening it
    failed to start ("database is locked" from the switch to WAL, which SQLite answers at once
    rather than after its busy wait). Opening retries such an answer within the busy timeout;
    another error, or a lock that outlasts the timeout, still fails, naming the problem."""
    import rtvoice.voices as voices

    real_connect = sqlite3.connect
    answers: list[str] = []

    class Contended:  # the first two switches to WAL find the file locked
        def __init__(self, *args, **kwargs):
            self._db = real_connect(*args, **kwargs)

        def execute(self, sql, *args):
            if sql == "PRAGMA journal_mode=WAL" and len(answers) < 2:
                answers.append("locked")
                raise sqlite3.OperationalError("database is locked")
            return self._db.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self._db, name)

    monkeypatch.setattr(voices.sqlite3, "connect", Contended)
    with VoiceStore(tmp_path) as store:
        assert answers == ["locked", "locked"]
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    monkeypatch.undo()

    def locked():
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(sqlite3.OperationalError, match="locked"):
        voices._while_locked(locked, timeout_s=0.05)
    calls = []

    def broken():
        calls.append(1)
        raise sqlite3.OperationalError("no such table: voices")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        voices._while_locked(broken)
    assert calls == [1]  # not a lock: no retry
