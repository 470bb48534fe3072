"""Check this engine against a reference fixture set (see tests/fixtures/README.md).

    python -m engine.verify_reference DIR [--codec-chunk N ...] [--skip-codec]

For every batch of every case: the prompt builder reproduces `prompt` exactly; greedy
decoding from it reproduces `generated` exactly; `slow_logits`, `slow_hidden` and
`fast_logits_step0` agree within LOGIT_TOL. Then the codec cases (offline, and streamed in
chunks of N frames with --codec-chunk). Runs in float32 with TF32 off and one thread, as the
reference did. Prints one line per check and a summary; exit status 0 only if all pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from .config import ModelConfig
from .loader import reconcile_ids
from .model import DualAR
from .ops import REFERENCE, Ops
from .prompt import PromptBuilder, Reference, speaker_batches
from .runner import ModelRunner
from .sampler import SamplingParams
from .tokenizer import HFTokenizer
from .weights import load_model

# Measured on fish_s2_tiny: max |diff| 5.1e-7 (logits), 2.1e-6 (hidden). The smallest greedy
# margins recorded are ~3.6e-4, so 1e-5 is tight enough to guarantee the same choices.
LOGIT_TOL = 1e-5

Check = tuple[str, bool, str]


class _Recorder:
    """Wraps a model's heads to keep what one decode step computed."""

    def __init__(self, model: DualAR) -> None:
        self.model = model
        self.hidden: list[Tensor] = []
        self.fast: list[Tensor] = []
        self._orig_sem = model.semantic_logits
        self._orig_fast = model.forward_fast

        def sem(h: Tensor, ops: Ops = REFERENCE) -> Tensor:
            self.hidden.append(h.detach().clone())
            return self._orig_sem(h, ops)

        def fast(x: Tensor, pos: int, attend, ops: Ops = REFERENCE) -> Tensor:  # type: ignore[no-untyped-def]
            # one call per position, or positions 0 and 1 together: one entry per position
            # (position 0's logits, which the reference records, come with the pair's head)
            out = self._orig_fast(x, pos, attend, ops)
            self.fast.extend(out[:, t].detach().clone() for t in range(out.shape[1]))
            return out

        model.semantic_logits = sem  # type: ignore[method-assign]
        model.forward_fast = fast  # type: ignore[method-assign]

    def restore(self) -> None:
        del self.model.semantic_logits
        del self.model.forward_fast


def _diff(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")


def model_checks(root: Path, device: str = "cpu", ops: Ops = REFERENCE) -> Iterator[Check]:
    """The engine's model path (prompt building, prefill, the device-resident decode step)
    against the reference's recorded prompts, greedy frames, hidden states and logits, with
    `ops` (the reference math by default; the GPU tests pass the fused ops too)."""
    cfg = ModelConfig.from_checkpoint(root)
    tok = HFTokenizer(root)
    cfg = reconcile_ids(cfg, tok)
    yield ("tokenizer.semantic_range", True,
           f"{tok.ids.semantic_start}..{tok.ids.semantic_end}, <|im_end|>={tok.ids.im_end}")
    model = load_model(root, cfg, dtype=torch.float32, device=device)
    builder = PromptBuilder(tok, cfg.num_codebooks)
    runner = ModelRunner(model, n_rows=1, max_len=cfg.slow.max_seq_len, ops=ops)
    case_files = sorted((root / "cases").glob("*.json"))
    if not case_files:
        yield ("cases", False, f"no cases/*.json under {root}")
    for case_path in case_files:
        case = json.loads(case_path.read_text())
        name = case["name"]
        t = load_file(str(case_path.with_suffix(".safetensors")))
        refs = [Reference(r["text"], t[r["tensor"]]) for r in case.get("references", [])]
        n_new = int(case["sampling"]["max_new_tokens"])
        # the case's whole text in the turns the reference generated (speaker batches)
        texts = speaker_batches(case["text"], int(case["chunk_length"]))
        want_texts = [b["batch_text"] for b in case["batches"]]
        yield (f"{name}.batches", texts == want_texts, f"{texts!r} vs {want_texts!r}")
        if texts != want_texts:
            continue
        slot = 0  # the runner's one row, reused case after case
        blocks = runner.own_blocks(slot)
        history: list[tuple[str, Tensor]] = []
        pos = 0
        for k in range(len(texts)):
            tag = f"{name}.b{k}"
            want = t[f"b{k}.prompt"]
            prompt = builder.build(texts[k], refs, history)
            ok = prompt.shape == want.shape and torch.equal(prompt, want)
            yield (f"{tag}.prompt", ok, f"{list(prompt.shape)} vs {list(want.shape)}")
            if not ok:
                break
            # Keep the KV cache across batches: only the new columns are prefilled.
            T = prompt.shape[1]
            new = prompt[:, pos:]
            if new.shape[1] > 1:
                runner.prefill(blocks, new[:, :-1], pos)
            pos, col = T - 1, new[:, -1][None]
            # The frame loop the engine runs: device-resident state, one dense step per frame.
            # As many steps as the reference took (fewer than max_new_tokens when it chose
            # <|im_end|>, whose frame is the last one it recorded).
            want_gen = t[f"b{k}.generated"]
            steps = min(n_new, want_gen.shape[1])
            runner.join(slot, SamplingParams.greedy(), col[0], pos, steps, 0, blocks)
            rec = _Recorder(model)
            frames = []
            try:
                for _ in range(steps):
                    out = runner.step(slot + 1, pos + 1)
                    frames.append(out[slot, : cfg.frame_rows].cpu())
                    pos += 1
            finally:
                rec.restore()
            got = torch.stack(frames, 1)
            bad = int((got != want_gen).sum()) if got.shape == want_gen.shape else -1
            yield (f"{tag}.generated", bad == 0,
                   f"{got.shape[1]} frames, {bad} mismatching values" if bad >= 0
                   else f"shape {list(got.shape)} vs {list(want_gen.shape)}")
            hid = torch.stack([h[0] for h in rec.hidden[:3]])
            want_hid = t[f"b{k}.slow_hidden"].to(device)
            d = _diff(hid, want_hid)
            yield (f"{tag}.slow_hidden", d <= LOGIT_TOL, f"max|diff| {d:.2e} (tol {LOGIT_TOL:.0e})")
            logits = model.full_logits(hid)
            d = _diff(logits, t[f"b{k}.slow_logits"].to(device))
            yield (f"{tag}.slow_logits", d <= LOGIT_TOL, f"max|diff| {d:.2e} (tol {LOGIT_TOL:.0e})")
            fast0 = torch.stack([f[0] for f in rec.fast[: cfg.num_codebooks]])
            d = _diff(fast0, t[f"b{k}.fast_logits_step0"].to(device))
            yield (f"{tag}.fast_logits_step0", d <= LOGIT_TOL,
                   f"max|diff| {d:.2e} (tol {LOGIT_TOL:.0e})")
            history.append((texts[k], t[f"b{k}.codes"]))
            pos = T + got.shape[1] - 1  # every frame but the last went back into the cache


def codec_checks_for(root: Path, chunks: list[int]) -> Iterator[Check]:
    from .codec.reference_checks import codec_checks

    yield from codec_checks(root, chunk_sizes=tuple(chunks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.verify_reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="fixture set directory (config.json, cases/, codec...)")
    ap.add_argument("--codec-chunk", type=int, action="append", default=[],
                    help="also stream the codec decode cases in chunks of N frames (repeatable)")
    ap.add_argument("--skip-codec", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    if any(c < 1 for c in args.codec_chunk):
        print("error: --codec-chunk must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    results: list[Check] = []
    sources: list[Iterator[Check]] = []
    if not args.skip_model:
        sources.append(model_checks(args.dir))
    if not args.skip_codec:
        sources.append(codec_checks_for(args.dir, args.codec_chunk))
    for src in sources:
        try:
            for check in src:
                results.append(check)
                print(f"{'PASS' if check[1] else 'FAIL'}  {check[0]:<40} {check[2]}", flush=True)
        except Exception as e:  # a broken fixture set is a failure, reported, not a traceback
            results.append(("error", False, f"{type(e).__name__}: {e}"))
            print(f"FAIL  {'error':<40} {type(e).__name__}: {e}", flush=True)
    failed = [c for c in results if not c[1]]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed in "
          f"{time.perf_counter() - t0:.1f}s" + (f"; FAILED: {', '.join(c[0] for c in failed)}"
                                               if failed else ""))
    return 0 if results and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
