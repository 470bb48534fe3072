"""Offline synthesis: text (+ optional reference clip) to a WAV file, through the same engine
the service uses. The simplest way to try a checkpoint.

The output path is checked before anything is loaded (its folder exists and is writable; an
existing file is kept unless ``overwrite``). The frame cap defaults to the server's segment
budget for the text (``default_max_frames``); random-weight presets never emit EOS, so theirs
is the text's expected speech duration. Progress goes to stderr while it runs."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from engine.config import EngineConfig
from engine.engine import CollectingSink, build_engine
from engine.loader import load_bundle
from engine.prompt import Reference
from engine.reference_audio import encode_reference
from engine.sampler import SamplingParams

from .segmenter import estimate_speech_seconds
from .settings import ServiceSettings
from .turns import frame_budget

log = logging.getLogger(__name__)


def check_output(out: Path, *, overwrite: bool = False) -> Path:
    """Refuse, before any work, an output the WAV could not be written to (ValueError)."""
    out = Path(out).expanduser()
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ValueError(f"output {out} is a directory; give a file name (e.g. {out / 'synth.wav'})")
    if not parent.is_dir():
        raise ValueError(f"output folder {parent} does not exist (create it: mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {parent} is not writable")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists; pass --overwrite to replace it, or another -o")
    if out.exists() and not os.access(out, os.W_OK):
        raise ValueError(f"{out} exists and is not writable")
    return out


def default_max_frames(text: str, frame_rate: float, *, random_weights: bool,
                       max_turn_frames: int | None = None) -> int:
    """The frame cap when none is given: the server's segment budget (``budget_multiplier`` x
    the text's expected speech duration, at least ``min_turn_frames``, at most
    ``max_turn_frames``). Random weights never end by themselves, so they get the expected
    duration itself: a second of noise for "Hello world.", not the whole budget."""
    cap = max_turn_frames or EngineConfig().max_turn_frames
    if random_weights:
        return max(1, min(cap, math.ceil(estimate_speech_seconds(text) * frame_rate)))
    svc = ServiceSettings()
    return frame_budget(text, multiplier=svc.budget_multiplier, min_frames=svc.min_turn_frames,
                        max_frames=cap, request_max=None, frame_rate=frame_rate)


class ProgressSink(CollectingSink):
    """Collects the audio and reports frames and seconds of audio so far on ``stream``:
    redrawn in place on a terminal (at most 10 times a second), a line every 2 s otherwise."""

    def __init__(self, sample_rate: int, frame_rate: float, max_frames: int,
                 stream: TextIO | None = None, enabled: bool = True) -> None:
        super().__init__()
        self.sample_rate = sample_rate
        self.frame_rate = frame_rate
        self.max_frames = max_frames
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.samples = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def on_audio(self, seq: Any, turn_id: str, pcm: Any, offset_s: float) -> None:
        super().on_audio(seq, turn_id, pcm, offset_s)
        self.samples += len(pcm)
        self.report()

    def line(self) -> str:
        audio_s = self.samples / self.sample_rate
        frames = round(audio_s * self.frame_rate)
        wall = time.perf_counter() - self.t0
        return (f"synth: {frames}/{self.max_frames} frames, {audio_s:.2f} s of audio, "
                f"{wall:.1f} s elapsed")

    def report(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < (0.1 if self.tty else 2.0):
            return
        self._last = now
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


def synthesize(text: str, out: Path, *, model: str = "tiny", device: str = "cpu",
               reference: Path | None = None, reference_text: str | None = None,
               seed: int = 0, max_frames: int | None = None, temperature: float = 0.8,
               top_p: float = 0.8, top_k: int = 30, overwrite: bool = False,
               progress: bool = True, stream: TextIO | None = None) -> dict[str, Any]:
    """Synthesize ``text`` into the WAV ``out``. ``max_frames`` None: ``default_max_frames``.
    Raises ValueError (bad output path or arguments, before any model is loaded),
    FileNotFoundError, RuntimeError."""
    import soundfile as sf

    err = stream or sys.stderr
    out = check_output(out, overwrite=overwrite)
    if not text.strip():
        raise ValueError("nothing to say: the text is empty")
    if max_frames is not None and max_frames < 1:
        raise ValueError("--max-frames must be >= 1")
    if reference is not None:
        if not reference_text:
            raise ValueError("--reference needs --reference-text (the transcript of the clip)")
        if not Path(reference).is_file():
            raise FileNotFoundError(f"reference clip {reference} not found")

    def say(msg: str) -> None:
        if progress:
            err.write(msg + "\n")
            err.flush()

    say(f"synth: loading model {model} on {device}")
    bundle = load_bundle(model, device=device, seed=seed)
    refs: list[Reference] = []
    if reference is not None:
        audio, sr = sf.read(str(reference), dtype="float32", always_2d=True)
        refs.append(encode_reference(bundle.codec, audio.mean(axis=1), sr, reference_text or ""))
    # offline, one turn: every graph captured while the engine is built, none mid-turn
    cfg = EngineConfig(max_running=1, max_len=bundle.model.cfg.slow.max_seq_len
                       if device != "cpu" else 4096, ready_rows=0)
    engine = build_engine(bundle, cfg)
    auto = max_frames is None
    cap = (default_max_frames(text, engine.frame_rate, random_weights=bundle.random_weights,
                              max_turn_frames=cfg.max_turn_frames) if auto else max_frames)
    assert cap is not None
    note = ""
    if bundle.random_weights:
        note = (" — random weights: noise, not speech, and no end of its own"
                + (" (capped at the text's expected duration)" if auto else ""))
    say(f"synth: up to {cap} frames ({cap / engine.frame_rate:.1f} s of audio{', auto' if auto else ''})"
        f"{note}")
    sink = ProgressSink(engine.sample_rate, engine.frame_rate, cap, stream=err, enabled=progress)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    t0 = time.perf_counter()
    seq = engine.open(refs, params, sink)
    engine.submit(seq, text, turn_id="synth", max_frames=cap)
    engine.run_until_idle(timeout_s=3600)
    sink.report(final=True)
    if sink.errors or not sink.results:
        raise RuntimeError(f"synthesis failed: {sink.errors}")
    res = sink.results[-1]
    if res.error:
        raise RuntimeError(f"synthesis failed: {res.error}")
    pcm = sink.pcm()
    # Written to a temporary name first: an interrupted write never leaves half a WAV behind.
    tmp = out.with_name(f".{out.name}.partial")
    try:
        sf.write(str(tmp), pcm, engine.sample_rate, subtype="PCM_16", format="WAV")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    reason = str(getattr(res.reason, "value", res.reason))
    return {"frames": res.frames, "max_frames": cap, "audio_s": len(pcm) / engine.sample_rate,
            "wall_s": wall, "reason": reason, "ttfa_ms": 1000 * (res.ttfa_s or 0.0),
            "random_weights": bundle.random_weights, "output": out}
