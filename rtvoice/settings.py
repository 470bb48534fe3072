"""Service settings, grouped by concern, with production defaults.

Every option has one flat, unique name (``port``, ``max_turn_frames``, ``data_dir``...), which is
also its environment variable (``RTVOICE_`` + the name in upper case: ``RTVOICE_PORT``,
``RTVOICE_MAX_TURN_FRAMES``) and its ``rtvoice serve`` flag (``--port``, ``--max-turn-frames``).
Unique names are what keep the three spellings trivially in sync: nothing maps one onto
another by hand.

Precedence: built-in defaults < environment < explicit overrides (CLI flags, ``running_server``
keyword arguments). Every group validates itself in ``__post_init__``, so a bad value fails at
startup with a message naming the option, never later inside a session.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Union

__all__ = [
    "ENV_PREFIX",
    "EngineSettings",
    "LimitSettings",
    "ModelSettings",
    "NetworkSettings",
    "Settings",
    "VoiceSettings",
    "option_help",
]

ENV_PREFIX: Final = "RTVOICE_"
log = logging.getLogger(__name__)


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "rtvoice"


def _positive(group: object, *names: str) -> None:
    for name in names:
        value = getattr(group, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(slots=True)
class NetworkSettings:
    """Where and how the HTTP/WebSocket server listens."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (tests)
    access_log: bool = False  # one line per HTTP request / socket; noisy under load
    ws_ping_interval_s: float = 20.0  # server keepalive pings (the Fish SDK pings too)
    ws_ping_timeout_s: float = 20.0
    graceful_shutdown_s: float = 10.0  # how long shutdown waits for open sessions
    api_keys: str | None = None  # comma-separated; None: no authentication (local use)

    HELP: ClassVar[dict[str, str]] = {
        "host": "interface to bind",
        "port": "TCP port (0 = any free port)",
        "access_log": "log every HTTP request and WebSocket connection",
        "ws_ping_interval_s": "seconds between keepalive pings",
        "ws_ping_timeout_s": "seconds to wait for a pong before dropping the socket",
        "graceful_shutdown_s": "seconds shutdown waits for open sessions",
        "api_keys": "comma-separated API keys; when set, /v1/tts/live and /v1/voices need "
        "'Authorization: Bearer KEY' (or ?api_key=KEY, for browsers); /health, /ready and "
        "/metrics stay open. Unset: no authentication (bind to 127.0.0.1 only)",
    }

    def __post_init__(self) -> None:
        if self.api_keys is not None and not self.keys():
            raise ValueError("api_keys is set but holds no key (comma-separated, non-empty)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        _positive(self, "ws_ping_interval_s", "ws_ping_timeout_s")
        if self.graceful_shutdown_s < 0:
            raise ValueError("graceful_shutdown_s must be >= 0")

    def keys(self) -> tuple[str, ...]:
        """The API keys a request may present (empty: authentication off)."""
        if self.api_keys is None:
            return ()
        return tuple(k.strip() for k in self.api_keys.split(",") if k.strip())


@dataclass(slots=True)
class ModelSettings:
    """Which model to load and where."""

    model: str = "tiny"  # preset (tiny, s2-pro: random weights) or a checkpoint directory
    device: str = "cpu"
    dtype: str | None = None  # None: fp32 on CPU, bf16 on accelerators
    seed: int = 0  # random-weight presets and engine seeds
    max_seq_len: int | None = None  # override the model's context length
    torch_threads: int | None = None  # torch intra-op threads; None = torch's default

    HELP: ClassVar[dict[str, str]] = {
        "model": "'tiny' (built-in, random weights), 's2-pro' (random weights at real size) "
        "or an S2-Pro checkpoint directory",
        "device": "cpu, cuda, cuda:1, ...",
        "dtype": "bf16, fp16 or fp32 (default: fp32 on CPU, bf16 otherwise)",
        "seed": "seed of random-weight presets and of sessions that send none",
        "max_seq_len": "cap the model's context length (positions)",
        "torch_threads": "torch intra-op threads",
    }

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ValueError("model must not be empty")
        if not self.device.strip():
            raise ValueError("device must not be empty")
        if self.dtype is not None:
            from engine.loader import DTYPES  # light import; validates the same names

            if self.dtype.lower() not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _positive(self, "max_seq_len", "torch_threads")

    @property
    def is_preset(self) -> bool:
        from engine.config import PRESETS

        return self.model in PRESETS


@dataclass(slots=True)
class EngineSettings:
    """Batching, chunking and the per-segment frame budget."""

    max_running: int | None = None  # KV slots = sessions resident; None: 8 CPU, 64 accelerator
    max_len: int | None = None  # KV positions per session; None: min(4096, model context)
    max_waiting: int = 64  # sessions queued for a slot before new ones are refused
    prefill_chunk: int = 256  # prefill columns per engine step (bounds decode stalls)
    first_chunk_frames: int = 1  # codec frames in a turn's first audio chunk (TTFA)
    slow_start_x: float = 2.0  # below this many x realtime per stream, first chunks are doubled
    chunk_frames: int = 8  # codec frames in later chunks
    codec_hold_s: float = 1.0  # a stream this far ahead of realtime may wait for a fuller codec tick
    # prefill first: decode pauses for a burst of prefills while every turn is this far ahead
    prefill_first_lead_s: float = 0.5
    prefill_first_wait_s: float = 0.05  # ...and a joined turn waits at most this for its first frames
    # Budget of one segment: ceil(estimated speech seconds * budget_multiplier * frame rate),
    # at least min_turn_frames, at most the request's max_new_tokens and max_turn_frames.
    budget_multiplier: float = 3.0
    min_turn_frames: int = 32
    max_turn_frames: int = 2048  # hard cap per segment (~95 s of audio)
    default_top_k: int = 30  # when the request sends no top_k (Fish's SDK never does)
    encode_threads: int = 2  # audio encoder pool (mp3/opus cost real CPU)
    kv_reserve_gib: float = 8.0  # GPU memory kept out of the KV cache (graphs, activations)

    HELP: ClassVar[dict[str, str]] = {
        "max_running": "KV slots = sessions resident at once: a session holds its slot from "
        "'start' until it closes, idle or not; later sessions wait for a slot (up to "
        "max_waiting), then get 'overloaded'. Default 8 on CPU, 64 on GPU",
        "max_len": "KV positions per session (voice prompt + turns); default min(4096, model "
        "context). A session's chunk_length is capped so that a segment always fits",
        "max_waiting": "sessions that may wait for a KV slot before new ones get 'overloaded'",
        "prefill_chunk": "prefill columns per engine step",
        "first_chunk_frames": "codec frames in the first audio chunk of a turn",
        "slow_start_x": "while streams generate slower than this many times realtime, a "
        "turn's first chunk is twice first_chunk_frames (a thicker start buffer where "
        "generation has little headroom); 0: never",
        "chunk_frames": "codec frames in later audio chunks",
        "codec_hold_s": "a stream more than this many seconds of audio ahead of realtime "
        "playback lets its chunk wait (up to 2 x chunk_frames) for a fuller batched codec "
        "tick; keep it well above the clients' jitter buffer; 0: every chunk is decoded as "
        "soon as it is ready",
        "prefill_first_lead_s": "while prompts are prefilling, decode steps pause if every "
        "running turn's audio is at least this many seconds ahead of realtime playback (a "
        "burst of new turns gets the GPU to itself: lower TTFA); keep it above a chunk's "
        "duration; 0: prefill and decode always share the GPU",
        "prefill_first_wait_s": "longest a turn whose prompt is in waits for its first frames "
        "while other prompts prefill (seconds)",
        "budget_multiplier": "segment budget = this x estimated speech duration",
        "min_turn_frames": "smallest segment budget (frames)",
        "max_turn_frames": "hard cap of one segment (frames; 21.5 frames = 1 s)",
        "default_top_k": "top-k when a request sends none",
        "encode_threads": "threads encoding audio (mp3, opus, resampling)",
        "kv_reserve_gib": "GPU memory (GiB) kept out of the KV cache for activations, CUDA "
        "graphs and the codec; the cache takes min(max_running, what fits) slots",
    }

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_running",
            "max_len",
            "prefill_chunk",
            "first_chunk_frames",
            "chunk_frames",
            "budget_multiplier",
            "min_turn_frames",
            "max_turn_frames",
            "default_top_k",
            "encode_threads",
        )
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_len is not None and self.max_len < 128:
            raise ValueError(f"max_len must be >= 128, got {self.max_len}")
        if not self.kv_reserve_gib >= 0:
            raise ValueError(f"kv_reserve_gib must be >= 0, got {self.kv_reserve_gib}")
        for name in ("codec_hold_s", "prefill_first_lead_s", "prefill_first_wait_s", "slow_start_x"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class LimitSettings:
    """Per-server and per-socket bounds: nothing a client sends can grow without limit."""

    max_sessions: int = 128  # live sessions (after ``start``); more get ``overloaded``
    max_message_bytes: int = 8 * 1024 * 1024  # one client frame; inline references need room
    max_text_chars: int = 50_000  # text buffered + queued per context, not yet spoken
    max_contexts: int = 8  # contexts with unfinished work on one socket
    max_references: int = 4  # inline references in one ``start``
    max_reference_s: float = 30.0  # seconds of audio per reference clip
    min_chunk_length: int = 10  # floor of a request's chunk_length (characters)
    max_chunk_length: int = 1000  # ceiling of a request's chunk_length
    idle_timeout_s: float = 120.0  # no client message and nothing generating -> ``timeout``
    send_queue_bytes: int = 16 * 1024 * 1024  # audio waiting for a slow reader, per socket
    send_queue_events: int = 4096  # events (any kind) waiting for a slow reader, per socket
    send_timeout_s: float = 30.0  # one frame that cannot be written for this long -> ``timeout``

    HELP: ClassVar[dict[str, str]] = {
        "max_sessions": "live sessions; further ones get 'overloaded'",
        "max_message_bytes": "largest client message (bytes)",
        "max_text_chars": "unspoken text per context (characters)",
        "max_contexts": "contexts with unfinished work per socket",
        "max_references": "inline reference clips per session",
        "max_reference_s": "longest reference clip (seconds)",
        "min_chunk_length": "smallest chunk_length honoured (characters)",
        "max_chunk_length": "largest chunk_length honoured (characters)",
        "idle_timeout_s": "close sockets idle this long (seconds)",
        "send_queue_bytes": "audio bytes queued for a slow reader before it is dropped",
        "send_queue_events": "events queued for a slow reader before it is dropped",
        "send_timeout_s": "drop a client that accepts no data for this long (seconds)",
    }

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_sessions",
            "max_message_bytes",
            "max_text_chars",
            "max_contexts",
            "max_references",
            "max_reference_s",
            "min_chunk_length",
            "max_chunk_length",
            "idle_timeout_s",
            "send_queue_bytes",
            "send_queue_events",
            "send_timeout_s",
        )
        if self.min_chunk_length > self.max_chunk_length:
            raise ValueError("min_chunk_length must be <= max_chunk_length")


@dataclass(slots=True)
class VoiceSettings:
    """The persistent voice store."""

    data_dir: Path = field(default_factory=_default_data_dir)
    max_voices: int = 1000
    max_upload_bytes: int = 16 * 1024 * 1024

    HELP: ClassVar[dict[str, str]] = {
        "data_dir": "directory of the voice store (created if missing)",
        "max_voices": "voices the store may hold",
        "max_upload_bytes": "largest voice upload (bytes)",
    }

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser()
        _positive(self, "max_voices", "max_upload_bytes")


_GROUPS: Final[dict[str, type]] = {
    "network": NetworkSettings,
    "model": ModelSettings,
    "engine": EngineSettings,
    "limits": LimitSettings,
    "voices": VoiceSettings,
}


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


# flat option name -> group attribute; built once, and checked for uniqueness once
_OWNER: Final[dict[str, str]] = {}
for _group, _cls in _GROUPS.items():
    for _f in _fields(_cls):
        if _f.name in _OWNER:
            raise RuntimeError(f"settings option name {_f.name!r} is not unique")
        _OWNER[_f.name] = _group


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(tp: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, True); ``Path`` -> (Path, False)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


_TRUE: Final = {"1", "true", "yes", "on"}
_FALSE: Final = {"0", "false", "no", "off"}


def parse_value(name: str, raw: str) -> Any:
    """Parse the string form (env var, CLI) of option ``name`` to its type."""
    group = _GROUPS[_OWNER[name]]
    base, optional = _base_type(_hints(group)[name])
    text = raw.strip()
    if optional and text.lower() in ("", "none", "auto"):
        return None
    try:
        if base is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("expected true/false")
        if base is int:
            return int(text.replace("_", ""))
        if base is float:
            return float(text)
        if base is Path:
            return Path(text)
        return text
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {exc}") from None


def option_help(name: str) -> str:
    return _GROUPS[_OWNER[name]].HELP.get(name, "")


def option_names() -> dict[str, list[str]]:
    """Group name -> its option names, in declaration order (for the CLI)."""
    return {g: [f.name for f in _fields(cls)] for g, cls in _GROUPS.items()}


def option_type(name: str) -> tuple[type, bool]:
    return _base_type(_hints(_GROUPS[_OWNER[name]])[name])


@dataclass(slots=True)
class Settings:
    """All settings. Build with ``Settings()`` (defaults), ``Settings.from_env(**overrides)``
    or ``settings.replace(**overrides)``; overrides use the flat option names."""

    network: NetworkSettings = field(default_factory=NetworkSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    voices: VoiceSettings = field(default_factory=VoiceSettings)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> Settings:
        """Defaults, then ``RTVOICE_*`` variables of ``environ`` (``os.environ``), then
        ``overrides``. Unknown ``RTVOICE_*`` variables are logged as warnings: a typo should
        be visible, but other tools may share the prefix."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        known = {ENV_PREFIX + name.upper(): name for name in _OWNER}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = known.get(key)
            if name is None:
                if key not in _IGNORED_ENV:
                    log.warning("ignoring unknown setting %s (known: %s)", key, ", ".join(sorted(known)))
                continue
            values[name] = parse_value(name, raw)
        values.update(overrides)
        return cls().replace(**values)

    def replace(self, **overrides: Any) -> Settings:
        """A copy with some options changed (flat names, or whole groups by group name)."""
        groups: dict[str, Any] = {g: getattr(self, g) for g in _GROUPS}
        per_group: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        for name, value in overrides.items():
            if name in _GROUPS and isinstance(value, _GROUPS[name]):
                groups[name] = value  # a whole group ("model" is also an option: the type decides)
                continue
            owner = _OWNER.get(name)
            if owner is None:
                raise TypeError(f"unknown setting {name!r}; known: {', '.join(sorted(_OWNER))}")
            per_group[owner][name] = value
        for g, changes in per_group.items():
            if changes:
                # dataclasses.replace re-runs __post_init__: every override is validated
                groups[g] = dataclasses.replace(groups[g], **changes)
        return Settings(**groups)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for g in _GROUPS:
            grp = getattr(self, g)
            out[g] = {
                f.name: (str(v) if isinstance(v := getattr(grp, f.name), Path) else v)
                for f in _fields(type(grp))
            }
        return out


# RTVOICE_* variables that are not settings, read elsewhere: the engine's CUDA kernel switch
# (csrc/README.md) and the reference fixtures of the tests (tests/_paths.py).
_IGNORED_ENV: Final = frozenset({"RTVOICE_CUDA_KERNELS", "RTVOICE_FIXTURES"})
