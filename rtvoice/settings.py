"""Service settings, grouped by concern, with production defaults.

Every option is declared once, in its group's dataclass (`engine.options.option`: type,
default, bounds, help); the engine group *is* the engine's own `EngineConfig`. From those
declarations come the validation, the ``rtvoice serve`` flag (``--max-turn-frames``), the
environment variable (``RTVOICE_`` + the name in upper case: ``RTVOICE_MAX_TURN_FRAMES``),
``--help`` and docs/OPTIONS.md (``python -m rtvoice.settings --markdown``). Option names are
unique across groups, which keeps the three spellings trivially in sync.

Precedence: built-in defaults < environment < explicit overrides (CLI flags, ``running_server``
keyword arguments). Every group validates itself, so a bad value fails at startup with a
message naming the option, never later inside a session.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from engine.config import PRECISION_NAMES, EngineConfig
from engine.options import describe, fields, option, parse, validate

__all__ = [
    "ENV_PREFIX",
    "EngineConfig",
    "LimitSettings",
    "ModelSettings",
    "NetworkSettings",
    "ServiceSettings",
    "Settings",
    "VoiceSettings",
    "default_text",
    "option_help",
    "option_names",
    "option_type",
    "parse_value",
]

ENV_PREFIX: Final = "RTVOICE_"
log = logging.getLogger(__name__)


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "rtvoice"


@dataclass(slots=True)
class NetworkSettings:
    """Where and how the HTTP/WebSocket server listens."""

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(8000, "TCP port (0 = any free port)", ge=0, le=65535)
    access_log: bool = option(False, "log every HTTP request and WebSocket connection")
    load_in_background: bool = option(
        False, "listen at once and load the model behind it: while it loads /health answers "
        "200 ('status': 'loading') and /ready 503, other routes 503 with Retry-After; a load "
        "that fails makes /health 503 and the process exit with status 1. For an orchestrator "
        "whose liveness probe would kill a slow start (S2-Pro on a fresh GPU machine: about "
        "2 minutes, most of it compiling kernels). Off: the port opens once the model is ready")
    ws_ping_interval_s: float = option(20.0, "seconds between keepalive pings", gt=0)
    ws_ping_timeout_s: float = option(
        60.0, "seconds to wait for a pong before dropping the socket; keep it above "
        "send_timeout_s, so that a client that stops reading is dropped by the slow-client "
        "rule (error 'timeout', counted) rather than by the keepalive", gt=0)
    drain_timeout_s: float = option(
        30.0, "drain on SIGTERM (or Ctrl-C): /ready turns 503 and new connections are refused "
        "(HTTP 503, code shutting_down) at once; sessions end as soon as their turns are done, "
        "for up to this many seconds, then every socket closes with 1001 ('shutting_down') and "
        "the process exits 0", ge=0)
    api_keys: str | None = option(
        None, "comma-separated API keys; when set, /v1/tts/live and /v1/voices need "
        "'Authorization: Bearer KEY' (or ?api_key=KEY, for browsers); /health, /ready and "
        "/metrics stay open. Unset: no authentication (bind to 127.0.0.1 only: the server "
        "warns when it listens elsewhere without keys)")
    log_format: str = option("text", "log lines as plain text, or as JSON objects (one per "
                             "line, with session and turn ids) for a log collector",
                             choices=("text", "json"))
    gpus: str | None = option(
        None, "several GPUs behind this one address: 'all' or indices '0,1,...'; one engine "
        "process per GPU (its own KV pool and graphs, one shared voice store), nginx in front "
        "(least connections, needs the nginx binary); unset: one process on --device")
    replicas: int = option(1, "engine processes on --device behind this one address (nginx "
                           "in front, as with --gpus); for CPUs and tests", ge=1, le=64)

    def __post_init__(self) -> None:
        validate(self)
        if self.api_keys is not None and not self.keys():
            raise ValueError("api_keys is set but holds no key (comma-separated, non-empty)")
        if self.gpus is not None:
            parts = [g.strip() for g in self.gpus.split(",")]
            if self.gpus.strip() != "all" and not all(p.isdigit() for p in parts):
                raise ValueError(f"gpus must be 'all' or GPU indices like '0,1', got "
                                 f"{self.gpus!r}")
            if len(set(parts)) != len(parts):
                raise ValueError(f"gpus names a GPU twice: {self.gpus!r}")
            if self.replicas > 1:
                raise ValueError("set gpus (one process per GPU) or replicas (processes on "
                                 "--device), not both")

    def keys(self) -> tuple[str, ...]:
        """The API keys a request may present (empty: authentication off)."""
        if self.api_keys is None:
            return ()
        return tuple(k.strip() for k in self.api_keys.split(",") if k.strip())


@dataclass(slots=True)
class ModelSettings:
    """Which model to load and where."""

    model: str = option("tiny", "'tiny' (built-in, random weights), 's2-pro' (random weights "
                        "at real size), an S2-Pro checkpoint directory, or a Hub model id "
                        "(org/name[@revision]: fetched into the Hub cache, or from it when "
                        "HF_HUB_OFFLINE=1; token: HF_TOKEN)")
    device: str = option("cpu", "cpu, cuda, cuda:1, ...")
    dtype: str | None = option(None, "bf16, fp16, fp32, or fp8: the transformer layers' linears "
                               "in FP8 e4m3 with 128x128 block scales (quantised at load unless "
                               "the checkpoint already is: `rtvoice quantize`), the rest in the "
                               "default dtype (default: fp32 on CPU, bf16 otherwise)",
                               choices=PRECISION_NAMES)
    fp8_keep: tuple[str, ...] = option((), "with --dtype fp8: layers kept in bf16, as "
                                       "comma-separated patterns of module names (e.g. "
                                       "'layers.34.attention.wo,layers.*.feed_forward.w2')")
    max_seq_len: int | None = option(None, "cap the model's context length (positions)", gt=0)
    torch_threads: int | None = option(None, "torch intra-op threads (default: 1 per engine "
                                       "thread on a CPU, torch's default elsewhere)", gt=0)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            self.dtype = self.dtype.lower()
        validate(self)
        if not self.model.strip():
            raise ValueError("ModelSettings.model must not be empty")
        if not self.device.strip():
            raise ValueError("ModelSettings.device must not be empty")

    @property
    def is_preset(self) -> bool:
        from engine.config import PRESETS

        return self.model in PRESETS


@dataclass(slots=True)
class ServiceSettings:
    """Per-session policy of the service: the frame budget of a segment, request defaults,
    the audio encoder pool."""

    # Budget of one segment: ceil(estimated speech seconds * budget_multiplier * frame rate),
    # at least min_turn_frames, at most the request's max_new_tokens and max_turn_frames.
    budget_multiplier: float = option(3.0, "segment budget = this x estimated speech duration",
                                      gt=0)
    min_turn_frames: int = option(32, "smallest segment budget (frames)", ge=1)
    default_top_k: int = option(30, "top-k when a request sends none (Fish's SDK never does)",
                                ge=1)
    encode_threads: int = option(2, "threads encoding audio (mp3, opus, resampling)", ge=1)
    heap_trim_s: float = option(5.0, "give freed heap memory back to the OS every this many "
                                "seconds (glibc malloc_trim; without it RSS ratchets up to its "
                                "worst moment); 0 = never", ge=0)
    gc_freeze: bool = option(True, "move every object alive at the start (model, compiled "
                             "kernels, graphs) into the garbage collector's permanent "
                             "generation, once ready and again when the background graphs are "
                             "in: its full passes, which hold every thread and so stall every "
                             "stream's audio, then scan only what sessions made since")
    gc_warn_ms: float = option(50.0, "log a warning when one garbage-collector pass holds the "
                               "threads longer than this (ms; every pass is timed in /metrics); "
                               "0 = never", ge=0)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(slots=True)
class LimitSettings:
    """Per-server and per-socket bounds: nothing a client sends can grow without limit."""

    max_sessions: int = option(128, "live sessions (after 'start'); further ones get "
                               "'overloaded'", ge=1)
    max_sessions_per_key: int = option(0, "live sessions one API key may hold (0: only "
                                       "max_sessions applies)", ge=0)
    max_unstarted: int = option(64, "connections that have not sent 'start' yet; more are "
                                "refused ('overloaded', close 1013)", ge=1)
    start_timeout_s: float = option(15.0, "a connection that sends no 'start' for this long is "
                                    "closed ('timeout')", gt=0)
    max_message_bytes: int = option(8 * 1024 * 1024, "largest client message (bytes); inline "
                                    "references need room", ge=1)
    max_nesting_depth: int = option(32, "deepest nesting of a client message (a flat map "
                                    "is 1; events need 4); deeper ones get "
                                    "'malformed_message'", ge=4, le=256)
    max_text_chars: int = option(50_000, "unspoken text per context (characters)", ge=1)
    max_contexts: int = option(8, "contexts with unfinished work per socket", ge=1)
    max_context_id_chars: int = option(128, "longest context_id (characters); it is echoed "
                                       "on every event of its context", ge=1, le=1024)
    max_references: int = option(4, "inline reference clips per session", ge=1)
    max_reference_s: float = option(30.0, "longest reference clip (seconds)", gt=0)
    max_reference_samples: int = option(
        48000 * 30 * 2, "most samples x channels one reference clip may decode to (its memory "
        "while decoding: 4 bytes each)", ge=1)
    reference_workers: int = option(2, "reference clips decoded and encoded at once (a bounded "
                                    "pool off the event loop; others wait their turn)", ge=1)
    min_chunk_length: int = option(10, "smallest chunk_length honoured (characters)", ge=1)
    max_chunk_length: int = option(1000, "largest chunk_length honoured (characters)", ge=1)
    reuse_timeout_s: float = option(
        60.0, "after finish{stop} the socket stays open this long for another 'start' (Fish's "
        "clients, LiveKit's plugin, reuse it), then closes 1000; 0: close at once", ge=0)
    idle_timeout_s: float = option(120.0, "close sockets idle this long: no client message and "
                                   "nothing generating (seconds)", gt=0)
    send_queue_bytes: int = option(16 * 1024 * 1024, "audio bytes queued for a slow reader "
                                   "before it is dropped", ge=1)
    send_queue_events: int = option(4096, "events (any kind) queued for a slow reader before "
                                    "it is dropped", ge=1)
    send_timeout_s: float = option(30.0, "drop a client that accepts no data for this long "
                                   "(seconds)", gt=0)

    def __post_init__(self) -> None:
        validate(self)
        if self.min_chunk_length > self.max_chunk_length:
            raise ValueError("min_chunk_length must be <= max_chunk_length")


@dataclass(slots=True)
class VoiceSettings:
    """The persistent voice store."""

    data_dir: Path = option(default_factory=_default_data_dir,
                            help="directory of the voice store (voices.sqlite; created if "
                            "missing); default $XDG_DATA_HOME/rtvoice, else "
                            "~/.local/share/rtvoice: one store shared by every install and "
                            "server of the user; set it to keep one apart (the server logs the "
                            "one it uses at start)")
    max_voices: int = option(1000, "voices the store may hold", ge=1)
    max_upload_bytes: int = option(16 * 1024 * 1024, "largest voice upload (bytes)", ge=1)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser()
        validate(self)


_GROUPS: Final[dict[str, type]] = {
    "network": NetworkSettings,
    "model": ModelSettings,
    "engine": EngineConfig,
    "service": ServiceSettings,
    "limits": LimitSettings,
    "voices": VoiceSettings,
}
GROUP_TITLES: Final = {
    "network": "network",
    "model": "model",
    "engine": "engine (batching, scheduling, chunking, speed-ups)",
    "service": "service (segment budget, request defaults)",
    "limits": "limits (per server and per socket)",
    "voices": "voice store",
}

# flat option name -> group; built once, and checked for uniqueness once
_OWNER: Final[dict[str, str]] = {}
for _group, _gcls in _GROUPS.items():
    for _name, *_ in fields(_gcls):
        if _name in _OWNER:
            raise RuntimeError(f"settings option name {_name!r} is not unique")
        _OWNER[_name] = _group


def parse_value(name: str, raw: str) -> Any:
    """Parse the string form (env var, CLI) of option ``name`` to its type."""
    try:
        return parse(_GROUPS[_OWNER[name]], name, raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {exc}") from None


def option_help(name: str) -> str:
    return describe(_GROUPS[_OWNER[name]], name)


def option_names() -> dict[str, list[str]]:
    """Group name -> its option names, in declaration order (for the CLI)."""
    return {g: [n for n, *_ in fields(cls)] for g, cls in _GROUPS.items()}


def default_text(name: str) -> str:
    """Option ``name``'s default as a user would type it ('none': unset, the help says what
    that means)."""
    group = _GROUPS[_OWNER[name]]
    f = next(f for f in dataclasses.fields(group) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return "see help"  # computed at start (data_dir: from $XDG_DATA_HOME or ~)
    v = f.default
    return "none" if v is None else ",".join(v) if isinstance(v, tuple) else str(v)


def option_type(name: str) -> tuple[Any, bool]:
    """(base type, optional) of option ``name``."""
    return next((b, o) for n, _, b, o in fields(_GROUPS[_OWNER[name]]) if n == name)


@dataclass(slots=True)
class Settings:
    """All settings. Build with ``Settings()`` (defaults), ``Settings.from_env(**overrides)``
    or ``settings.replace(**overrides)``; overrides use the flat option names."""

    network: NetworkSettings = field(default_factory=NetworkSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineConfig = field(default_factory=EngineConfig)
    service: ServiceSettings = field(default_factory=ServiceSettings)
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
        for g, cls in _GROUPS.items():
            grp = getattr(self, g)
            out[g] = {}
            for name, *_ in fields(cls):
                v = getattr(grp, name)
                out[g][name] = str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
        return out


def markdown() -> str:
    """Every option as a Markdown table per group: flag, environment variable, default and
    help (docs/OPTIONS.md is this text; a test keeps it current)."""
    lines = ["# Options", "",
             "Every option of `rtvoice serve`: a flag, and the environment variable beside it "
             "(flags win over the environment, which wins over the defaults). Generated by "
             "`python -m rtvoice.settings --markdown` from the declarations in "
             "`rtvoice/settings.py` and `engine/config.py` (`EngineConfig`); "
             "`tests/test_server_units.py` checks that this file is current.", ""]
    for g, names in option_names().items():
        lines += [f"## {GROUP_TITLES[g]}", "", "| flag | environment | default | meaning |",
                  "|---|---|---|---|"]
        for name in names:
            help_ = option_help(name).replace("|", "\\|")
            lines.append(f"| `--{name.replace('_', '-')}` | `{ENV_PREFIX}{name.upper()}` | "
                         f"`{default_text(name)}` | {help_} |")
        lines.append("")
    return "\n".join(lines)


# RTVOICE_* variables that are not settings, read elsewhere: the reference fixtures of the
# tests (tests/_paths.py).
_IGNORED_ENV: Final = frozenset({"RTVOICE_FIXTURES"})

if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m rtvoice.settings --markdown   (prints docs/OPTIONS.md)")
    print(markdown(), end="")
