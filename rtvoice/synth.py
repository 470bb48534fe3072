"""Offline synthesis: text (+ optional reference clip) to a WAV file, through the same engine
the service uses. The simplest way to try a checkpoint."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.engine import CollectingSink, build_engine
from engine.loader import load_bundle
from engine.prompt import Reference
from engine.reference_audio import encode_reference
from engine.sampler import SamplingParams

log = logging.getLogger(__name__)


def synthesize(text: str, out: Path, *, model: str = "tiny", device: str = "cpu",
               reference: Path | None = None, reference_text: str | None = None,
               seed: int = 0, max_frames: int = 600, temperature: float = 0.8, top_p: float = 0.8,
               top_k: int = 30) -> dict[str, float]:
    import soundfile as sf

    bundle = load_bundle(model, device=device, seed=seed)
    refs: list[Reference] = []
    if reference is not None:
        if not reference_text:
            raise ValueError("--reference needs --reference-text (the transcript of the clip)")
        audio, sr = sf.read(str(reference), dtype="float32", always_2d=True)
        refs.append(encode_reference(bundle.codec, audio.mean(axis=1), sr, reference_text))
    engine = build_engine(bundle, EngineConfig(max_running=1, max_len=bundle.model.cfg.slow.max_seq_len
                                              if device != "cpu" else 4096))
    sink = CollectingSink()
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    t0 = time.perf_counter()
    seq = engine.open(refs, params, sink)
    engine.submit(seq, text, turn_id="synth", max_frames=max_frames)
    engine.run_until_idle(timeout_s=3600)
    if sink.errors or not sink.results:
        raise RuntimeError(f"synthesis failed: {sink.errors}")
    res = sink.results[-1]
    if res.error:
        raise RuntimeError(f"synthesis failed: {res.error}")
    pcm = sink.pcm()
    sf.write(str(out), pcm, engine.sample_rate, subtype="PCM_16")
    wall = time.perf_counter() - t0
    return {"frames": res.frames, "audio_s": len(pcm) / engine.sample_rate, "wall_s": wall,
            "reason": str(res.reason), "ttfa_ms": 1000 * (res.ttfa_s or 0.0)}
