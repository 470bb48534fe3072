"""Every CUDA graph capture in the engine names its stream.

cuBLAS keeps one workspace per (handle, stream) and a captured graph keeps the workspace of
the stream it was captured on. `torch.cuda.graph` without `stream=` captures on one shared
side stream, so the decode, prefill and codec graphs would all carry the same workspace and
race on it when their threads replay them at once (split-K GEMMs coordinate through it). Each
family must be captured on the stream that replays it (engine/engine.py passes them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _graph_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "graph"
            and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "cuda"]


def test_every_engine_graph_capture_names_its_stream():
    """The engine captures through one routine, which begins each capture on the stream
    it is given; no bare `torch.cuda.graph` (its side stream, its device-wide sync)."""
    for path in sorted((ROOT / "engine").rglob("*.py")):
        calls = _graph_calls(ast.parse(path.read_text(encoding="utf-8")))
        assert not calls, f"{path.relative_to(ROOT)}:{calls[0].lineno}: torch.cuda.graph(...) " \
            "in the engine: capture through engine.capture.capture_graphs"
    src = (ROOT / "engine" / "capture.py").read_text(encoding="utf-8")
    body = src[src.index("def _capturing"):]
    assert body.index("with torch.cuda.stream(side):") < body.index("g.capture_begin(")
    # decode, prefill and codec graphs all go through that one routine
    for family in ("engine/runner.py", "engine/prefill_graphs.py", "engine/codec/streaming.py"):
        assert "capture_graphs(" in (ROOT / family).read_text(encoding="utf-8"), family


def test_engine_passes_each_family_its_replay_stream():
    """Each worker gets its own stream from the engine and captures its graphs on it."""
    src = (ROOT / "engine" / "engine.py").read_text(encoding="utf-8")
    for role in ("decode", "prefill", "codec"):
        assert f'self._stream("{role}")' in src, f"engine/engine.py should make a {role} stream"
    for path, call in (("decode_worker.py", "self.runner.capture_steps(self.stream,"),
                       ("prefill_worker.py", "self.graphs.capture(self.stream, keys)"),
                       ("codec_worker.py", "self.decoder.capture(self.stream, keys)")):
        src = (ROOT / "engine" / path).read_text(encoding="utf-8")
        assert call in src, f"engine/{path} should call {call}"
        if path != "decode_worker.py":
            # graphs captured after the start (engine/warmup.py): on a fresh stream of their
            # own, never the worker's (its thread launches into it meanwhile)
            later = src[src.index("def capture_later"):]
            assert "torch.cuda.Stream(" in later.split("\n    def ")[0], path
