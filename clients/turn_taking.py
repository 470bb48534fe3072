"""Turn-taking demo: a scripted conversation against a running server, played like a voice
agent plays it.

    python -m clients.turn_taking clients/examples/conversation.json \\
        --url ws://127.0.0.1:8000/v1/tts/live --out demo_out/

Each agent turn's text arrives as a token stream at LLM speed (``tokens_per_s``), audio is
played in real time through a jitter buffer (to the sound card when ``sounddevice`` is
installed and an output device exists, otherwise only to WAV files, written in real time),
and the simulated user barges in where the script says so: the demo stops playback at once,
sends ``cancel``, and starts the next turn on the same socket. A live timeline goes to stdout;
``--out`` gets one WAV per turn (exactly the audio that was played) and ``log.json``.

Script format (JSON; YAML too when PyYAML is installed)::

    {
      "title": "Booking a table",              # optional
      "voice": null,                           # stored voice id (reference_id), optional
      "reference": {"audio": "ref.wav", "text": "transcript"},  # inline voice, optional;
                                               # a relative path is relative to the script
      "sample_rate": 44100,                    # playback / WAV rate (the demo asks for pcm)
      "tokens_per_s": 20,                      # LLM speed (default 20)
      "jitter_ms": 150,                        # playback jitter buffer (default 150)
      "seed": 1,                               # sampling seed, optional
      "request": {"max_new_tokens": 400},      # any other TTSRequest field, optional
      "turns": [
        {"user": "Hi! Can I book a table?",    # what the user said (printed), optional
         "user_s": 1.0,                        # how long the user speaks first (default
                                               # 0.6 s when "user" is given, else 0)
         "agent": "Of course. For how many?"}, # the agent's reply: streamed as tokens
        {"user": "Four.", "agent": "A long answer ...",
         "barge_in_after_s": 1.5},             # the user interrupts after 1.5 s of this
                                               # turn's audio has played
        {"user": "Sorry, make it five.", "agent": "Five it is.", "tokens_per_s": 40}
      ]
    }

Every turn uses its own ``context_id`` (``turn-1``, ``turn-2``...): late events of a
cancelled turn can never be mistaken for the next turn's, and any that arrived would be
counted in the log (``late_audio_bytes``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import wave
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from .client import (
    RtvoiceError,
    Session,
    Turn,
    TurnResult,
    connect,
    llm_tokens,
    paced,
)

__all__ = ["AgentTurn", "JitterPlayer", "Script", "load_script", "main", "run_demo"]

DEFAULT_TOKENS_PER_S = 20.0
DEFAULT_JITTER_MS = 150.0
DEFAULT_USER_S = 0.6


# ============================================================================================
# Script
# ============================================================================================


@dataclass(slots=True)
class AgentTurn:
    agent: str
    user: str | None = None
    user_s: float | None = None
    barge_in_after_s: float | None = None
    tokens_per_s: float | None = None
    context_id: str | None = None


@dataclass(slots=True)
class Script:
    turns: list[AgentTurn]
    title: str = ""
    voice: str | None = None
    reference: tuple[Path, str] | None = None
    sample_rate: int = 44100
    tokens_per_s: float = DEFAULT_TOKENS_PER_S
    jitter_ms: float = DEFAULT_JITTER_MS
    seed: int | None = None
    request: dict[str, Any] = field(default_factory=dict)


_TURN_KEYS = {f for f in AgentTurn.__dataclass_fields__}
_SCRIPT_KEYS = {"turns", "title", "voice", "reference", "sample_rate", "tokens_per_s",
                "jitter_ms", "seed", "request"}


def parse_script(data: Any, base_dir: Path = Path(".")) -> Script:
    """Validate a script (already parsed JSON/YAML) and resolve relative paths."""
    if not isinstance(data, dict):
        raise ValueError("a script is a map with a 'turns' list")
    unknown = set(data) - _SCRIPT_KEYS
    if unknown:
        raise ValueError(f"unknown script keys: {', '.join(sorted(unknown))}")
    raw_turns = data.get("turns")
    if not isinstance(raw_turns, list) or not raw_turns:
        raise ValueError("'turns' must be a non-empty list")
    turns = []
    for i, t in enumerate(raw_turns, 1):
        if isinstance(t, str):
            t = {"agent": t}
        if not isinstance(t, dict) or not isinstance(t.get("agent"), str) or not t["agent"].strip():
            raise ValueError(f"turn {i}: needs a non-empty 'agent' text")
        bad = set(t) - _TURN_KEYS
        if bad:
            raise ValueError(f"turn {i}: unknown keys {', '.join(sorted(bad))}")
        turn = AgentTurn(**t)
        if turn.barge_in_after_s is not None and turn.barge_in_after_s < 0:
            raise ValueError(f"turn {i}: barge_in_after_s must be >= 0")
        turns.append(turn)
    ref = data.get("reference")
    reference = None
    if ref is not None:
        if not isinstance(ref, dict) or "audio" not in ref or "text" not in ref:
            raise ValueError("'reference' needs 'audio' (a path) and 'text'")
        path = Path(ref["audio"])
        reference = (path if path.is_absolute() else base_dir / path, str(ref["text"]))
    request = data.get("request") or {}
    if not isinstance(request, dict):
        raise ValueError("'request' must be a map of TTSRequest fields")
    return Script(
        turns=turns, title=str(data.get("title", "")), voice=data.get("voice"),
        reference=reference, sample_rate=int(data.get("sample_rate", 44100)),
        tokens_per_s=float(data.get("tokens_per_s", DEFAULT_TOKENS_PER_S)),
        jitter_ms=float(data.get("jitter_ms", DEFAULT_JITTER_MS)), seed=data.get("seed"),
        request=request)


def load_script(path: str | Path) -> Script:
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise SystemExit("YAML scripts need PyYAML (pip install pyyaml); "
                             "or write the script as JSON") from None
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    return parse_script(data, path.parent)


# ============================================================================================
# Playback
# ============================================================================================


class Output(Protocol):
    def write(self, pcm_s16le: bytes) -> None: ...
    def abort(self) -> None: ...  # drop anything queued: barge-in must be silent at once
    def close(self) -> None: ...


class WavOutput:
    """The turn's WAV file, written as the audio is played (so it holds exactly that)."""

    def __init__(self, path: Path, sample_rate: int) -> None:
        self.path = path
        self._w = wave.open(str(path), "wb")
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(sample_rate)

    def write(self, pcm_s16le: bytes) -> None:
        self._w.writeframes(pcm_s16le)

    def abort(self) -> None:
        pass  # nothing is queued: what was written was played

    def close(self) -> None:
        self._w.close()


class SoundDeviceOutput:
    """The sound card through ``sounddevice``. The player hands over audio as its clock plays
    it; a small FIFO bridges that to the device callback."""

    def __init__(self, sample_rate: int) -> None:
        import threading

        import sounddevice as sd  # type: ignore[import-not-found]

        self._fifo = bytearray()
        self._lock = threading.Lock()
        self._stream = sd.RawOutputStream(samplerate=sample_rate, channels=1, dtype="int16",
                                          latency="low", callback=self._callback)
        self._stream.start()

    def _callback(self, outdata: Any, frames: int, time_info: Any, status: Any) -> None:
        n = frames * 2
        with self._lock:
            chunk = bytes(self._fifo[:n])
            del self._fifo[:n]
        outdata[: len(chunk)] = chunk
        outdata[len(chunk):] = b"\x00" * (n - len(chunk))

    def write(self, pcm_s16le: bytes) -> None:
        with self._lock:
            self._fifo += pcm_s16le

    def abort(self) -> None:
        with self._lock:
            self._fifo.clear()

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()


def sound_device_available() -> bool:
    try:
        import sounddevice as sd  # type: ignore[import-not-found]

        sd.query_devices(kind="output")
    except Exception:  # no module, no PortAudio, or no output device
        return False
    return True


class JitterPlayer:
    """Real-time playback of one turn's s16le PCM through a jitter buffer.

    Playback starts ``jitter_s`` after the first audio arrives (a fixed playout delay: early
    chunks wait in the buffer and absorb later network and generation jitter). A clock hands the outputs exactly the samples that
    are due; when the buffer runs dry before the turn's audio is complete, that is an
    underrun: playback pauses, and resumes ``jitter_s`` after audio arrives again. This is
    the model of ``bench_latency.stats.simulate_playback``, so the demo and the bench count
    underruns the same way.
    """

    def __init__(self, sample_rate: int, jitter_s: float, outputs: list[Output], *,
                 tick_s: float = 0.01, on_event: Callable[..., None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sr = sample_rate
        self.jitter_s = jitter_s
        self._fill_since: float | None = None
        self.outputs = outputs
        self.tick_s = tick_s
        self.on_event = on_event or (lambda *a, **k: None)
        self.clock = clock
        self._buf = bytearray()
        self.received_samples = 0
        self.played_samples = 0
        self.input_done = False
        self.state = "buffering"  # buffering | playing | done | stopped
        self.underruns = 0
        self.stall_s = 0.0
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.stopped_at: float | None = None
        self._stall_from: float | None = None
        self._seg_t0 = 0.0
        self._seg_base = 0

    @property
    def played_s(self) -> float:
        return self.played_samples / self.sr

    @property
    def finished(self) -> bool:
        return self.state in ("done", "stopped")

    def push(self, pcm_s16le: bytes) -> None:
        if self.state == "stopped":
            return
        self._buf += pcm_s16le
        self.received_samples += len(pcm_s16le) // 2

    def end_of_input(self) -> None:
        self.input_done = True

    def stop(self) -> float:
        """Barge-in: silence now. Returns the moment the outputs went silent."""
        if self.state != "stopped":
            self.state = "stopped"
            self._buf.clear()
            for o in self.outputs:
                o.abort()
            self.stopped_at = self.clock()
        assert self.stopped_at is not None
        return self.stopped_at

    def _write(self, n: int) -> None:
        data = bytes(self._buf[: 2 * n])
        del self._buf[: 2 * n]
        for o in self.outputs:
            o.write(data)
        self.played_samples += n

    def step(self, now: float) -> None:
        """Advance playback to ``now`` (one clock tick)."""
        if self.state == "buffering":
            buffered = len(self._buf) // 2
            if buffered and self._fill_since is None:
                self._fill_since = now  # the first audio after a start or a stall
            waited = now - self._fill_since if self._fill_since is not None else 0.0
            if buffered and waited >= self.jitter_s - 1e-9:
                self._fill_since = None
                self.state = "playing"
                self._seg_t0, self._seg_base = now, self.played_samples
                if self.started_at is None:
                    self.started_at = now
                    self.on_event("playback_start", buffered_ms=1000 * buffered / self.sr)
                else:
                    assert self._stall_from is not None
                    self.stall_s += now - self._stall_from
                    self.on_event("playback_resume", stalled_ms=1000 * (now - self._stall_from))
            elif self.input_done and not buffered:
                self.state, self.ended_at = "done", now
                return
        if self.state == "playing":
            due = int((now - self._seg_t0) * self.sr) + self._seg_base - self.played_samples
            avail = len(self._buf) // 2
            if min(due, avail) > 0:
                self._write(min(due, avail))
            if due > avail:
                if self.input_done:
                    if not self._buf:
                        self.state, self.ended_at = "done", now
                else:
                    self.underruns += 1
                    # Starved since the last sample ran out, which may be inside this tick.
                    dry_at = self._seg_t0 + (self.played_samples - self._seg_base) / self.sr
                    self.state, self._stall_from = "buffering", min(now, dry_at)
                    self.on_event("underrun", n=self.underruns, played_s=self.played_s)

    async def run(self) -> None:
        while not self.finished:
            self.step(self.clock())
            if self.finished:
                break
            await asyncio.sleep(self.tick_s)


# ============================================================================================
# The conversation
# ============================================================================================


@dataclass(slots=True)
class TurnLog:
    index: int
    context_id: str
    text: str
    user: str | None
    tokens: int
    tokens_per_s: float
    start_s: float  # relative to the session start
    text_done_s: float | None = None
    flush_s: float | None = None
    first_audio_s: float | None = None
    playback_start_s: float | None = None
    end_s: float | None = None
    client_ttfa_ms: float | None = None  # flush -> first audio; None if the audio came first
    first_audio_after_first_text_ms: float | None = None
    audio_before_flush: bool = False
    server_ttfa_ms: float | None = None
    reason: str | None = None
    frames: int = 0
    audio_received_s: float = 0.0
    played_s: float = 0.0
    underruns: int = 0
    stall_s: float = 0.0
    chunks: int = 0
    wav: str | None = None
    wav_samples: int = 0
    barge_in: dict[str, Any] | None = None
    late_audio_bytes: int = 0  # audio of this context received after its done (must be 0)
    error: str | None = None


class Timeline:
    """Prints events as they happen and keeps them for the log."""

    def __init__(self, t0: float, quiet: bool = False, stream: Any = None) -> None:
        self.t0 = t0
        self.quiet = quiet
        self.stream = stream or sys.stdout
        self.events: list[dict[str, Any]] = []

    def __call__(self, turn: int | None, event: str, text: str = "", **data: Any) -> None:
        t = time.perf_counter() - self.t0
        self.events.append({"t": round(t, 4), "turn": turn, "event": event, **data})
        if not self.quiet:
            who = f"turn {turn:<2}" if turn is not None else "session"
            self.stream.write(f"[{t:7.3f}s] {who} {event:<16} {text}\n")
            self.stream.flush()


def _fmt_fields(d: dict[str, Any]) -> str:
    def one(k: str, v: Any) -> str:
        if isinstance(v, float):
            return f"{k}={v:.0f}" if k.endswith("_ms") else f"{k}={v:.2f}"
        return f"{k}={v}"

    return ", ".join(one(k, v) for k, v in d.items())


def _s16_samples(data: bytes) -> int:
    return len(data) // 2


async def play_turn(session: Session, idx: int, spec: AgentTurn, script: Script, out_dir: Path,
                    tl: Timeline, use_sound: bool) -> TurnLog:
    ctx = spec.context_id or f"turn-{idx}"
    tps = spec.tokens_per_s or script.tokens_per_s
    tokens = llm_tokens(spec.agent)
    sr = session.sample_rate or script.sample_rate
    if spec.user:
        user_s = DEFAULT_USER_S if spec.user_s is None else spec.user_s
        tl(idx, "user", f"{spec.user!r} ({user_s:.1f} s)")
        await asyncio.sleep(user_s)
    elif spec.user_s:
        await asyncio.sleep(spec.user_s)
    log = TurnLog(idx, ctx, spec.agent, spec.user, len(tokens), tps,
                  start_s=time.perf_counter() - tl.t0)
    rel = lambda t: None if t is None else round(t - tl.t0, 4)  # noqa: E731
    wav_path = out_dir / f"turn_{idx:02d}.wav"
    outputs: list[Output] = [WavOutput(wav_path, sr)]
    if use_sound:
        outputs.append(SoundDeviceOutput(sr))
    player = JitterPlayer(sr, script.jitter_ms / 1000.0, outputs,
                          on_event=lambda ev, **d: tl(idx, ev, _fmt_fields(d), **d))
    turn: Turn = session.open_turn(ctx)
    tl(idx, "agent_text", f"{len(tokens)} tokens @ {tps:g} tok/s: {spec.agent[:60]!r}")

    async def send_text() -> None:
        await session.feed(paced(tokens, tps), context_id=ctx)
        log.text_done_s = rel(turn.flush_at)
        tl(idx, "flush", "text complete, turn flushed")

    async def receive() -> None:
        async for chunk in turn:
            if log.first_audio_s is None:
                log.first_audio_s = rel(chunk.received_at)
                if turn.flush_at is not None:
                    ttfa = f"{1000 * (chunk.received_at - turn.flush_at):.0f} ms after flush"
                else:  # the server started at the first sentence end, before the flush
                    since = chunk.received_at - (turn.first_text_at or chunk.received_at)
                    ttfa = f"before flush, {1000 * since:.0f} ms after the first token"
                tl(idx, "first_audio", ttfa)
            player.push(chunk.data)
        player.end_of_input()

    sender = asyncio.create_task(send_text())
    receiver = asyncio.create_task(receive())
    playing = asyncio.create_task(player.run())
    barge: dict[str, Any] | None = None
    result: TurnResult | None = None
    try:
        if spec.barge_in_after_s is not None:
            # The user interrupts once this much of the turn has been heard.
            while not player.finished and player.played_s < spec.barge_in_after_s:
                await asyncio.sleep(player.tick_s / 2)
            if not player.finished:
                barge = await barge_in(session, turn, ctx, idx, player, sender, tl)
            else:
                tl(idx, "no_barge_in", "the turn ended before the scripted barge-in")
        await asyncio.wait({playing})
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        result = await turn
        await receiver
    except RtvoiceError as exc:
        log.error = exc.code
        tl(idx, "error", str(exc))
        for task in (sender, receiver, playing):
            task.cancel()
    finally:
        for o in outputs:
            o.close()
    log.flush_s = rel(turn.flush_at)
    log.playback_start_s = rel(player.started_at)
    log.played_s = round(player.played_s, 6)
    log.underruns = player.underruns
    log.stall_s = round(player.stall_s, 4)
    log.chunks = len(turn.chunks)
    log.audio_received_s = round(sum(_s16_samples(c.data) for c in turn.chunks) / sr, 6)
    log.wav = wav_path.name
    with wave.open(str(wav_path), "rb") as w:
        log.wav_samples = w.getnframes()
    log.barge_in = barge
    log.end_s = round(time.perf_counter() - tl.t0, 4)
    if result is not None:
        log.reason = result.reason
        log.frames = result.frames
        r2 = lambda x: None if x is None else round(x, 2)  # noqa: E731
        log.client_ttfa_ms = r2(result.client_ttfa_ms)
        log.first_audio_after_first_text_ms = r2(result.first_audio_after_first_text_ms)
        log.audio_before_flush = result.audio_before_flush
        log.server_ttfa_ms = r2(result.server_ttfa_ms)
        client = (f"audio before flush ({log.first_audio_after_first_text_ms} ms after the first "
                  "token)" if log.audio_before_flush else f"{log.client_ttfa_ms} ms after flush")
        tl(idx, "done", f"reason={result.reason} ttfa client {client} / server "
           f"{log.server_ttfa_ms} ms, received {log.audio_received_s:.2f} s, played "
           f"{log.played_s:.2f} s, underruns {log.underruns}", reason=result.reason)
    return log


async def barge_in(session: Session, turn: Turn, ctx: str, idx: int, player: JitterPlayer,
                   sender: asyncio.Task[None], tl: Timeline) -> dict[str, Any]:
    """Interrupt: silence first (the user must not hear another sample), then tell the
    server, then wait for its confirmation."""
    at = time.perf_counter()
    played = player.played_s
    silent_at = player.stop()
    if not sender.done():
        sender.cancel()  # the LLM stream is abandoned too
    info: dict[str, Any] = {
        "after_s": played,
        "at_s": round(at - tl.t0, 4),
        "silence_s": round(silent_at - tl.t0, 4),
        "cancel_to_silence_ms": round(1000 * (silent_at - at), 3),
    }
    if turn.finished:
        # The server had already sent all of this turn: only the local playback had more
        # to say, and stopping it was the whole barge-in. A cancel would hit an idle context.
        tl(idx, "barge_in", f"after {played:.2f} s played: silence after "
           f"{1000 * (silent_at - at):.1f} ms (the server had finished the turn)",
           played_s=played)
        return {**info, "cancel_sent": False, "cancel_sent_s": None, "done_s": None,
                "cancel_to_done_ms": None, "in_flight_bytes": 0,
                "reason": turn.result_.reason if turn.result_ else None}
    cancel_at = time.perf_counter()
    received_at_cancel = len(turn.chunks)
    await session.cancel(ctx)
    tl(idx, "barge_in", f"after {played:.2f} s played: silence after "
       f"{1000 * (silent_at - at):.1f} ms, cancel sent", played_s=played)
    result = await turn
    done_at = result.done_at
    after_cancel = sum(len(c.data) for c in turn.chunks[received_at_cancel:])
    tl(idx, "cancel_confirmed", f"done({result.reason}) {1000 * (done_at - cancel_at):.0f} ms "
       f"after cancel; {after_cancel} bytes were in flight")
    return {
        **info,
        "cancel_sent": True,
        "cancel_sent_s": round(cancel_at - tl.t0, 4),
        "done_s": round(done_at - tl.t0, 4),
        "cancel_to_done_ms": round(1000 * (done_at - cancel_at), 2),
        "in_flight_bytes": after_cancel,  # arrived between cancel and done; never played
        "reason": result.reason,
    }


async def run_demo(script: Script, url: str, out_dir: Path, *, sound: str = "auto",
                   quiet: bool = False, encoding: str = "msgpack",
                   timeout: float = 60.0) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    use_sound = sound == "on" or (sound == "auto" and sound_device_available())
    if sound == "on" and not sound_device_available():
        raise SystemExit("--sound on: sounddevice is not installed or there is no output device")
    t0 = time.perf_counter()
    tl = Timeline(t0, quiet=quiet)
    tl(None, "connect", f"{url} (playback: {'sound card + ' if use_sound else ''}WAV files)")
    ref = script.reference
    session = await connect(url, voice=script.voice, reference=ref, format="pcm",
                            sample_rate=script.sample_rate, seed=script.seed,
                            encoding=encoding, timeout=timeout, **script.request)
    logs: list[TurnLog] = []
    try:
        ready = await session.wait_ready()
        tl(None, "ready", f"voice prefilled in {ready.prefill_ms:.0f} ms, {ready.sample_rate} Hz, "
           f"model {ready.model!r}")
        for i, spec in enumerate(script.turns, 1):
            logs.append(await play_turn(session, i, spec, script, out_dir, tl, use_sound))
            if logs[-1].error:
                break
        # Anything of a finished context that arrived after its done would have opened a
        # new turn in the session: count it per context (a correct server sends none).
        for lg in logs:
            extra = [t for t in session.turns if t.context_id == lg.context_id][1:]
            lg.late_audio_bytes = sum(len(c.data) for t in extra for c in t.chunks)
        with contextlib.suppress(RtvoiceError, TimeoutError):
            await asyncio.wait_for(session.stop(), 10)
        tl(None, "finish", "session stopped")
    finally:
        await session.close()
    log = {
        "title": script.title,
        "url": url,
        "settings": {"sample_rate": script.sample_rate, "tokens_per_s": script.tokens_per_s,
                     "jitter_ms": script.jitter_ms, "seed": script.seed,
                     "voice": script.voice, "request": script.request,
                     "reference": str(ref[0]) if ref else None,
                     "playback": "sounddevice+wav" if use_sound else "wav"},
        "server": msgspec.to_builtins(session.info) if session.info else None,
        "turns": [asdict(lg) for lg in logs],
        "summary": {
            "turns": len(logs),
            "completed": sum(1 for lg in logs if lg.reason in ("eos", "length")),
            "barge_ins": sum(1 for lg in logs if lg.barge_in),
            "errors": sum(1 for lg in logs if lg.error),
            "underruns": sum(lg.underruns for lg in logs),
            "late_audio_bytes": sum(lg.late_audio_bytes for lg in logs),
            "wall_s": round(time.perf_counter() - t0, 3),
        },
        "timeline": tl.events,
    }
    (out_dir / "log.json").write_text(json.dumps(log, indent=1, ensure_ascii=False))
    return log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rtvoice-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("script", help="conversation script (.json, or .yaml with PyYAML)")
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/live")
    ap.add_argument("--out", default="demo_out", help="directory for turn WAVs and log.json")
    ap.add_argument("--tokens-per-s", type=float, help="override the script's LLM speed")
    ap.add_argument("--jitter-ms", type=float, help="override the script's jitter buffer")
    ap.add_argument("--sample-rate", type=int, help="override the script's sample rate")
    ap.add_argument("--sound", choices=["auto", "on", "off"], default="auto",
                    help="play to the sound card (auto: when sounddevice and a device exist)")
    ap.add_argument("--encoding", choices=["msgpack", "json"], default="msgpack")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--quiet", action="store_true", help="no live timeline")
    args = ap.parse_args(argv)
    try:
        script = load_script(args.script)
    except (OSError, ValueError) as exc:
        ap.error(f"bad script {args.script}: {exc}")
    if args.tokens_per_s:
        script.tokens_per_s = args.tokens_per_s
    if args.jitter_ms is not None:
        script.jitter_ms = args.jitter_ms
    if args.sample_rate:
        script.sample_rate = args.sample_rate
    try:
        log = asyncio.run(run_demo(script, args.url, Path(args.out), sound=args.sound,
                                   quiet=args.quiet, encoding=args.encoding,
                                   timeout=args.timeout))
    except RtvoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    s = log["summary"]
    print(f"{s['turns']} turns ({s['completed']} completed, {s['barge_ins']} barge-ins, "
          f"{s['errors']} errors, {s['underruns']} underruns) -> {args.out}/log.json")
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
