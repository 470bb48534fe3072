"""Persistent store of voices: a transcript plus the reference audio's codec codes.

One SQLite file (``voices.sqlite``) under the store's root, in WAL mode so that readers never
wait for a writer and a crash mid-write leaves the previous state intact. Codes are stored
as a raw little-endian blob with their shape and dtype, so a voice loads with one query and
one ``np.frombuffer`` (no pickle: the file must never execute anything on load).

The store does not encode audio: the service encodes the reference once at upload with the
codec and passes the codes here. It is safe to use from several threads (one connection,
guarded by a lock; SQLite calls are short).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

__all__ = [
    "DB_FILENAME",
    "UnknownVoice",
    "Voice",
    "VoiceInfo",
    "VoiceLimitError",
    "VoiceStore",
    "VoiceStoreConfig",
]

DB_FILENAME: Final = "voices.sqlite"
_SCHEMA_VERSION: Final = 1
_BUSY_TIMEOUT_S: Final = 10.0  # how long a store waits for another process's lock


def _while_locked(step: Any, timeout_s: float = _BUSY_TIMEOUT_S) -> None:
    """Run `step`, again after a short pause while SQLite says the database is locked or busy
    (where it does not wait by itself: see VoiceStore._set_up), for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as e:
            transient = "locked" in str(e) or "busy" in str(e)
            if not transient or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.5)
_ID_BYTES: Final = 9  # -> 12 url-safe characters, 72 random bits

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS voices (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    transcript  TEXT NOT NULL,
    sample_rate INTEGER NOT NULL,
    duration_s  REAL NOT NULL,
    created_at  REAL NOT NULL,
    codebooks   INTEGER NOT NULL,
    frames      INTEGER NOT NULL,
    dtype       TEXT NOT NULL,
    codes       BLOB NOT NULL,
    meta        TEXT NOT NULL DEFAULT '{}'
)
"""
_INFO_COLUMNS: Final = (
    "id, name, transcript, sample_rate, duration_s, created_at, codebooks, frames, meta"
)


class UnknownVoice(LookupError):
    """No voice with this id (the service reports ``unknown_voice``)."""

    def __init__(self, voice_id: str) -> None:
        self.voice_id = voice_id
        super().__init__(f"unknown voice id {voice_id!r}")


class VoiceLimitError(ValueError):
    """The store is full, or a voice is larger than allowed (the service reports ``too_large``)."""


@dataclass(slots=True)
class VoiceStoreConfig:
    max_voices: int = 1000
    max_frames: int = 1024  # codec frames per voice: 47.6 s at 21.53 Hz
    num_codebooks: int = 10
    max_name_chars: int = 200
    max_transcript_chars: int = 5000

    def __post_init__(self) -> None:
        for name in (
            "max_voices",
            "max_frames",
            "num_codebooks",
            "max_name_chars",
            "max_transcript_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class VoiceInfo:
    """A voice without its codes: what listings return."""

    id: str
    name: str
    transcript: str
    sample_rate: int  # of the uploaded reference audio
    duration_s: float  # of the uploaded reference audio
    created_at: float  # unix time
    codebooks: int
    frames: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "transcript": self.transcript,
            "sample_rate": self.sample_rate,
            "duration_s": self.duration_s,
            "created_at": self.created_at,
            "codebooks": self.codebooks,
            "frames": self.frames,
            "meta": dict(self.meta),
        }


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: ndarray == is elementwise
class Voice:
    """A stored voice: its info and its codes ``[codebooks, frames]`` (read-only array)."""

    info: VoiceInfo
    codes: np.ndarray

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def transcript(self) -> str:
        return self.info.transcript


def _info_from_row(row: tuple[Any, ...]) -> VoiceInfo:
    vid, name, transcript, rate, duration, created, books, frames, meta = row
    return VoiceInfo(
        vid,
        name,
        transcript,
        int(rate),
        float(duration),
        float(created),
        int(books),
        int(frames),
        json.loads(meta),
    )


class VoiceStore:
    """SQLite-backed voice store rooted at ``root`` (created if missing)."""

    def __init__(self, root: Path | str, config: VoiceStoreConfig | None = None) -> None:
        self.root = Path(root)
        self.config = config or VoiceStoreConfig()
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / DB_FILENAME
        self._lock = threading.Lock()
        # check_same_thread=False: the lock, not the creating thread, serialises access.
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves so that the count check and
        # the insert in add() are one atomic step even across processes.
        self._db = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=_BUSY_TIMEOUT_S
        )
        with self._lock:
            try:
                _while_locked(self._set_up)
            except BaseException:
                self._db.close()
                raise

    def _set_up(self) -> None:
        """WAL mode and the schema; each step idempotent, so a retry starts over."""
        # Switching to WAL needs the whole file to itself, and SQLite answers "database is
        # locked" at once (no busy wait) when another process is opening it at that moment
        # (two replicas starting together): switch only if another has not already
        if self._db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; safe in WAL
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema version {version}; this build knows {_SCHEMA_VERSION}"
            )
        self._db.execute(_SCHEMA)
        if version != _SCHEMA_VERSION:
            self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> VoiceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations --------------------------------------------------------------------------

    def add(
        self,
        name: str,
        transcript: str,
        codes: np.ndarray,
        meta: Mapping[str, Any] | None = None,
        *,
        sample_rate: int,
        duration_s: float,
    ) -> Voice:
        """Store a voice and return it with its new id.

        ``codes``: integer array ``[num_codebooks, frames]`` with values in 0..32767.
        ``sample_rate``/``duration_s`` describe the uploaded reference audio. ``meta``: any
        JSON-serialisable extra data. Raises ``VoiceLimitError`` / ``ValueError``.
        """
        cfg = self.config
        name = name.strip() or "voice"
        if len(name) > cfg.max_name_chars:
            raise VoiceLimitError(f"voice name is longer than {cfg.max_name_chars} characters")
        if len(transcript) > cfg.max_transcript_chars:
            raise VoiceLimitError(
                f"transcript is longer than {cfg.max_transcript_chars} characters"
            )
        if not transcript.strip():
            raise ValueError("transcript must not be empty: the prompt pairs it with the codes")
        blob, dtype, frames = self._pack_codes(codes)
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        if not duration_s >= 0:
            raise ValueError(f"duration_s must be >= 0, got {duration_s}")
        meta_json = json.dumps(dict(meta or {}), ensure_ascii=False, allow_nan=False)
        created = time.time()

        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (count,) = self._db.execute("SELECT COUNT(*) FROM voices").fetchone()
                if count >= cfg.max_voices:
                    raise VoiceLimitError(f"the voice store is full ({cfg.max_voices} voices)")
                while True:
                    vid = secrets.token_urlsafe(_ID_BYTES)
                    try:
                        self._db.execute(
                            "INSERT INTO voices (id, name, transcript, sample_rate, duration_s, "
                            "created_at, codebooks, frames, dtype, codes, meta) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (
                                vid,
                                name,
                                transcript,
                                int(sample_rate),
                                float(duration_s),
                                created,
                                cfg.num_codebooks,
                                frames,
                                dtype,
                                blob,
                                meta_json,
                            ),
                        )
                        break
                    except sqlite3.IntegrityError:  # id collision: 2**-72 per pair, but cheap
                        continue
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        info = VoiceInfo(
            vid,
            name,
            transcript,
            int(sample_rate),
            float(duration_s),
            created,
            cfg.num_codebooks,
            frames,
            json.loads(meta_json),
        )
        return Voice(info, self._unpack_codes(blob, dtype, cfg.num_codebooks, frames))

    def get(self, voice_id: str) -> Voice:
        """The voice with this id, codes included; raises ``UnknownVoice``."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_INFO_COLUMNS}, dtype, codes FROM voices WHERE id = ?", (voice_id,)
            ).fetchone()
        if row is None:
            raise UnknownVoice(voice_id)
        info = _info_from_row(row[:9])
        return Voice(info, self._unpack_codes(row[10], row[9], info.codebooks, info.frames))

    def info(self, voice_id: str) -> VoiceInfo:
        """The voice's info without loading its codes; raises ``UnknownVoice``."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_INFO_COLUMNS} FROM voices WHERE id = ?", (voice_id,)
            ).fetchone()
        if row is None:
            raise UnknownVoice(voice_id)
        return _info_from_row(row)

    def find(self, id_or_name: str) -> VoiceInfo | None:
        """The voice with this id, else the newest one with this name (None: neither)."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_INFO_COLUMNS} FROM voices WHERE id = ? OR name = ? "
                "ORDER BY id = ? DESC, created_at DESC LIMIT 1",
                (id_or_name, id_or_name, id_or_name)).fetchone()
        return None if row is None else _info_from_row(row)

    def list(self) -> list[VoiceInfo]:
        """All voices, oldest first, without their codes."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_INFO_COLUMNS} FROM voices ORDER BY created_at, id"
            ).fetchall()
        return [_info_from_row(r) for r in rows]

    def delete(self, voice_id: str) -> None:
        """Remove a voice; raises ``UnknownVoice`` if there is none with this id."""
        with self._lock:
            cur = self._db.execute("DELETE FROM voices WHERE id = ?", (voice_id,))
        if cur.rowcount == 0:
            raise UnknownVoice(voice_id)

    def __contains__(self, voice_id: object) -> bool:
        if not isinstance(voice_id, str):
            return False
        with self._lock:
            return (
                self._db.execute("SELECT 1 FROM voices WHERE id = ?", (voice_id,)).fetchone()
                is not None
            )

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM voices").fetchone()[0])

    # -- codes (de)serialisation ---------------------------------------------------------------

    def _pack_codes(self, codes: np.ndarray) -> tuple[bytes, str, int]:
        arr = np.asarray(codes)
        cfg = self.config
        if arr.ndim != 2 or arr.shape[0] != cfg.num_codebooks:
            raise ValueError(
                f"codes must have shape [{cfg.num_codebooks}, frames], got {arr.shape}"
            )
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"codes must be integers, got dtype {arr.dtype}")
        frames = int(arr.shape[1])
        if frames < 1:
            raise ValueError("codes must hold at least one frame")
        if frames > cfg.max_frames:
            raise VoiceLimitError(f"voice has {frames} frames; the limit is {cfg.max_frames}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 32767:
            raise ValueError(f"code values must be in 0..32767, got {lo}..{hi}")
        # int16 holds every codebook index (< 4096); keep int32 input as int32 so a caller
        # gets back the dtype it stored.
        dtype = "<i4" if arr.dtype == np.int32 else "<i2"
        return np.ascontiguousarray(arr, dtype=dtype).tobytes(), dtype, frames

    @staticmethod
    def _unpack_codes(blob: bytes, dtype: str, codebooks: int, frames: int) -> np.ndarray:
        arr = np.frombuffer(blob, dtype=np.dtype(dtype)).reshape(codebooks, frames)
        arr.flags.writeable = False  # voices are shared between sessions; nobody may mutate one
        return arr
