"""The service's counters and their Prometheus text exposition (``GET /metrics``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from engine.engine import Engine

__all__ = ["Metrics", "render_metrics"]


class Metrics:
    """Service counters for ``/metrics``. Updated and read on the event loop only."""

    TTFA_BUCKETS: Final = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
    PREFILL_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
    WAIT_BUCKETS: Final = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
    RECENT: Final = 2048  # TTFA values (one per segment) kept for the quantiles

    def __init__(self) -> None:
        self.connections_total = 0
        self.connections_open = 0
        self.sessions_total = 0  # sessions that got past ``start``
        self.sessions_live = 0
        self.turns: dict[str, int] = {}  # by done reason
        self.segments_total = 0
        self.frames_total = 0
        self.audio_seconds_total = 0.0
        self.audio_bytes_total = 0
        self.errors: dict[str, int] = {}  # by error code
        self.slow_clients = 0  # sessions dropped because a send/encode bound overflowed
        self.limit_hits: dict[str, int] = {}  # by limit (option name): refused or cut by it
        self.drops: dict[str, int] = {}  # sessions the server ended, by cause
        self.unstarted = 0  # connections open that have not sent 'start' yet
        self.lingering = 0  # sockets kept after finish{stop} for another start
        self.draining = False
        self.references_running = 0  # reference clips decoding/encoding now (bounded pool)
        self.references_waiting = 0  # ... and waiting for a worker
        self.slot_wait_counts = [0] * (len(self.WAIT_BUCKETS) + 1)
        self.slot_wait_sum = 0.0
        self.ttfa_counts = [0] * (len(self.TTFA_BUCKETS) + 1)
        self.ttfa_sum = 0.0
        self.ttfa_recent: deque[float] = deque(maxlen=self.RECENT)
        self.prefill_counts = [0] * (len(self.PREFILL_BUCKETS) + 1)
        self.prefill_sum = 0.0

    @staticmethod
    def _observe(buckets: tuple[float, ...], counts: list[int], value: float) -> None:
        for i, b in enumerate(buckets):
            if value <= b:
                counts[i] += 1
                return
        counts[-1] += 1

    def observe_ttfa(self, seconds: float) -> None:
        """One segment's TTFA (handed to the engine -> first audio handed to the socket)."""
        self._observe(self.TTFA_BUCKETS, self.ttfa_counts, seconds)
        self.ttfa_sum += seconds
        self.ttfa_recent.append(seconds)

    def observe_prefill(self, seconds: float) -> None:
        self._observe(self.PREFILL_BUCKETS, self.prefill_counts, seconds)
        self.prefill_sum += seconds

    def observe_slot_wait(self, seconds: float) -> None:
        """How long a session waited in the engine's queue for KV blocks."""
        self._observe(self.WAIT_BUCKETS, self.slot_wait_counts, seconds)
        self.slot_wait_sum += seconds

    def limit_hit(self, limit: str) -> None:
        """Something was refused or cut because of the configured limit `limit`."""
        self.limit_hits[limit] = self.limit_hits.get(limit, 0) + 1

    def dropped(self, cause: str) -> None:
        """The server ended a session, for `cause`."""
        self.drops[cause] = self.drops.get(cause, 0) + 1

    def turn_done(self, reason: str) -> None:
        self.turns[reason] = self.turns.get(reason, 0) + 1

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def ttfa_quantiles(self, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        if not self.ttfa_recent:
            return {}
        arr = np.fromiter(self.ttfa_recent, dtype=np.float64)
        return {q: float(np.quantile(arr, q)) for q in qs}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(m: Metrics, engine: Engine, *, model: str, device: str,
                   random_weights: bool, queued_bytes: int = 0,
                   gc: dict[str, Any] | None = None) -> str:
    """Prometheus text exposition (format 0.0.4) of the service's and the engine's counters."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            out.append(f"{name}{labels} {value:.9g}" if isinstance(value, float) else
                       f"{name}{labels} {value}")

    def histogram(name: str, help_: str, buckets: tuple[float, ...], counts: list[int],
                  total: float) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} histogram")
        acc = 0
        for b, c in zip(buckets, counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        acc += counts[-1]
        out.append(f'{name}_bucket{{le="+Inf"}} {acc}')
        out.append(f"{name}_sum {total:.9g}")
        out.append(f"{name}_count {acc}")

    metric("rtvoice_model_info", "gauge", "The served model.", [
        (f'{{model="{_label(model)}",device="{_label(device)}",'
         f'random_weights="{str(random_weights).lower()}"}}', 1)])
    metric("rtvoice_connections_total", "counter", "WebSocket connections accepted.",
           [("", m.connections_total)])
    metric("rtvoice_connections_open", "gauge", "WebSocket connections open now.",
           [("", m.connections_open)])
    metric("rtvoice_sessions_total", "counter", "Sessions started (a 'start' accepted).",
           [("", m.sessions_total)])
    metric("rtvoice_sessions_live", "gauge", "Sessions started and not yet closed.",
           [("", m.sessions_live)])
    metric("rtvoice_turns_total", "counter", "Turns (utterances) ended, by done reason.",
           [(f'{{reason="{_label(r)}"}}', n) for r, n in sorted(m.turns.items())])
    metric("rtvoice_segments_total", "counter", "Segments handed to the engine.",
           [("", m.segments_total)])
    metric("rtvoice_frames_total", "counter", "Codec frames generated.", [("", m.frames_total)])
    metric("rtvoice_audio_seconds_total", "counter", "Seconds of audio delivered in finished turns.",
           [("", float(m.audio_seconds_total))])
    metric("rtvoice_audio_bytes_total", "counter", "Encoded audio bytes sent.",
           [("", m.audio_bytes_total)])
    metric("rtvoice_errors_total", "counter", "Error events sent, by code.",
           [(f'{{code="{_label(c)}"}}', n) for c, n in sorted(m.errors.items())])
    metric("rtvoice_slow_clients_total", "counter", "Sessions dropped (error timeout) because "
           "the client did not read fast enough (send queue or encoder backlog full, or no "
           "data accepted for send_timeout_s).", [("", m.slow_clients)])
    metric("rtvoice_limit_hits_total", "counter", "Requests refused or cut by a configured "
           "limit, by limit (the option's name).",
           [(f'{{limit="{_label(k)}"}}', n) for k, n in sorted(m.limit_hits.items())])
    metric("rtvoice_drops_total", "counter", "Sessions the server ended, by cause (slow_reader, "
           "idle, no_start, shutdown, error).",
           [(f'{{cause="{_label(k)}"}}', n) for k, n in sorted(m.drops.items())])
    metric("rtvoice_queued_audio_bytes", "gauge", "Audio held for sessions: encoded, waiting "
           "for the socket, and raw, waiting for the encoder (bounded per session by "
           "send_queue_bytes and the encode backlog).", [("", queued_bytes)])
    metric("rtvoice_connections_unstarted", "gauge", "Connections open that have not sent "
           "'start' yet (bounded by max_unstarted).", [("", m.unstarted)])
    metric("rtvoice_connections_lingering", "gauge", "Sockets kept open after finish{stop} "
           "for another start (reuse_timeout_s; the oldest is closed when a new connection "
           "would exceed max_unstarted).", [("", m.lingering)])
    metric("rtvoice_draining", "gauge", "1 while the server drains (after SIGTERM).",
           [("", int(m.draining))])
    if gc is not None:  # gc_pauses.GcWatch.snapshot()
        gens = range(3)
        metric("rtvoice_gc_passes_total", "counter", "Garbage-collector passes by generation "
               "(each holds every thread: no step, tick or send meanwhile).",
               [(f'{{generation="{g}"}}', int(gc["passes"][g])) for g in gens])
        metric("rtvoice_gc_pause_seconds_total", "counter", "Time in garbage-collector passes.",
               [(f'{{generation="{g}"}}', float(gc["seconds"][g])) for g in gens])
        metric("rtvoice_gc_pause_max_seconds", "gauge", "The longest garbage-collector pass "
               "since the start (every stream's audio stalls for it).",
               [(f'{{generation="{g}"}}', float(gc["longest"][g])) for g in gens])
        metric("rtvoice_gc_frozen_objects", "gauge", "Objects in the collector's permanent "
               "generation (the start-up heap when gc_freeze is on: never scanned).",
               [("", int(gc["frozen"]))])
    metric("rtvoice_reference_jobs", "gauge", "Reference clips being decoded and encoded, and "
           "waiting for a worker (reference_workers).",
           [('{state="running"}', m.references_running),
            ('{state="waiting"}', m.references_waiting)])
    histogram("rtvoice_ttfa_seconds", "Time to first audio per segment (segment handed to "
              "the engine, i.e. ready to generate -> its first audio chunk handed to the "
              "socket).", Metrics.TTFA_BUCKETS, m.ttfa_counts, m.ttfa_sum)
    metric("rtvoice_ttfa_recent_seconds", "summary",
           f"TTFA quantiles over the last {Metrics.RECENT} segments.",
           [(f'{{quantile="{q:g}"}}', float(v)) for q, v in m.ttfa_quantiles().items()])
    histogram("rtvoice_prefill_seconds", "Voice prompt prefill time (open -> ready).",
              Metrics.PREFILL_BUCKETS, m.prefill_counts, m.prefill_sum)
    histogram("rtvoice_slot_wait_seconds", "Time a session waited in the engine's queue for "
              "KV blocks for its voice (part of its prefill time).", Metrics.WAIT_BUCKETS,
              m.slot_wait_counts, m.slot_wait_sum)
    load = engine.load()
    metric("rtvoice_engine_sequences", "gauge", "Engine sequences by state.",
           [('{state="live"}', load["live"]), ('{state="waiting"}', load["waiting"])])
    used = load["max_running"] - load["free_rows"]
    metric("rtvoice_engine_free_rows", "gauge", "Free decode rows (turns that may start "
           "speaking now).", [("", load["free_rows"])])
    metric("rtvoice_engine_rows", "gauge", "Decode rows (turns speaking at once), by use.",
           [('{state="used"}', used), ('{state="free"}', load["free_rows"])])
    metric("rtvoice_engine_row_utilization", "gauge", "Share of decode rows in use (0..1): the "
           "autoscaling signal.", [("", float(used / max(1, load["max_running"])))])
    metric("rtvoice_engine_queued_turns", "gauge", "Turns waiting for a decode row or KV "
           "blocks.", [("", load["queued_turns"])])
    metric("rtvoice_engine_kv_blocks", "gauge", "KV pool blocks, by use.",
           [('{state="used"}', load["kv_blocks"] - load["kv_blocks_free"]),
            ('{state="free"}', load["kv_blocks_free"])])
    metric("rtvoice_engine_offloaded_sessions", "gauge", "Idle sessions whose KV is in host "
           "memory.", [("", load["offloaded"])])
    metric("rtvoice_engine_graphs_warming", "gauge", "CUDA graphs still being captured in "
           "the background after the start (their buckets run eagerly until then).",
           [("", sum(int(f["total"]) - int(f["captured"]) for f in engine.warming().values()))])
    metric("rtvoice_engine_shared_prefixes", "gauge", "Voice prompts kept in the KV pool for "
           "sharing.", [("", load["shared_prefixes"])])
    metric("rtvoice_engine_device_wait_seconds", "gauge",
           "How long the engine has been waiting on the device right now (a stall if large).",
           [("", load["device_wait_s"])])
    metric("rtvoice_engine_loop_stall_seconds", "gauge",
           "How long an engine worker thread has been in one pass of its loop (step, tick, prefill round) "
           "(milliseconds when healthy; a stuck thread if large).", [("", load["loop_stall_s"])])
    stats = engine.stats
    metric("rtvoice_engine_steps_total", "counter", "Engine steps.", [("", int(stats["steps"]))])
    metric("rtvoice_engine_seconds_total", "counter", "Engine time by phase.",
           [(f'{{phase="{p}"}}', float(stats[f"{p}_s"])) for p in ("prefill", "decode", "codec")])
    metric("rtvoice_engine_codec_slow_ticks_total", "counter", "Codec ticks that took longer "
           "than the audio they made (streams fall behind realtime; the log says why).",
           [("", int(stats["codec_slow_ticks"]))])
    metric("rtvoice_engine_prefill_ahead_total", "counter", "Turn heads prefilled while their "
           "text streamed: jobs run, and turns that began with their head (hit) or not (miss: "
           "rolled back).", [(f'{{result="{k}"}}', int(stats[f"ahead_{k}"]))
                              for k in ("jobs", "hits", "misses")])
    metric("rtvoice_engine_prefill_ahead_columns_total", "counter", "Prompt columns queued to "
           "prefill ahead of their turn.", [("", int(stats["ahead_cols"]))])
    metric("rtvoice_engine_row_waits_total", "counter", "Prefilled turns that waited for a "
           "decode row (every row speaking): all, and those continuing an utterance the client "
           "plays (served first; a wait there risks a gap in its audio).",
           [('{kind="all"}', int(stats["row_waits"])),
            ('{kind="continuation"}', int(stats["continuation_row_waits"]))])
    metric("rtvoice_engine_continuations_total", "counter", "Turns that continue an utterance "
           "whose audio already plays (its later sentences).", [("", int(stats["continuations"]))])
    return "\n".join(out) + "\n"
