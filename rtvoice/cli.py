"""`rtvoice` command line: `serve` (the WebSocket service), `synth` (offline, to a WAV) and
`inspect` (what a checkpoint holds and how it will load), `quantize` (an FP8 copy of a
checkpoint)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEFAULT_OUTPUT = Path("synth.wav")  # rtvoice synth -o


def _synth(args: argparse.Namespace) -> int:
    from .synth import synthesize

    info = synthesize(args.text, args.output, model=args.model, device=args.device,
                      reference=args.reference, reference_text=args.reference_text, seed=args.seed,
                      max_frames=args.max_frames, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, overwrite=args.overwrite,
                      progress=not args.quiet)
    why = {"eos": "the model ended it", "length": "hit the frame cap"}.get(info["reason"],
                                                                          info["reason"])
    print(f"wrote {info['output']}: {info['audio_s']:.2f}s of audio, {info['frames']} frames "
          f"({why}) in {info['wall_s']:.2f}s")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from engine.inspect_checkpoint import inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint)
    print(report.text())
    return 1 if report.problems else 0


def _quantize(args: argparse.Namespace) -> int:
    from engine.weights import quantize_checkpoint

    keep = tuple(p.strip() for p in (args.keep or "").split(",") if p.strip())
    info = quantize_checkpoint(args.checkpoint, args.output, keep=keep, device=args.device,
                               overwrite=args.overwrite)
    print(f"wrote {info['output']}: {info['fp8_layers']} FP8 linears, {info['kept']} kept in "
          f"bf16, {int(info['bytes']) / 2**30:.2f} GiB of weights")  # type: ignore[call-overload]
    return 0


def _fp8_gate(args: argparse.Namespace) -> int:
    from engine.fp8_gate import main as gate

    return gate(args.gate_args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rtvoice", description="Realtime streaming TTS for Fish "
                                 "Audio S2-style DualAR models.")
    ap.add_argument("--log-level", default="INFO",
                    help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "synth", help="synthesize TEXT to a WAV file (offline, no server)",
        description="Synthesize TEXT to a 16-bit WAV file through the same engine the server "
        "uses, with progress on stderr. The output is checked before the model loads: its "
        "folder must exist and be writable, and an existing file is kept unless --overwrite. "
        "The built-in presets (tiny, s2-pro) have random weights: they make noise, not speech, "
        "and never end by themselves.")
    s.add_argument("text", help="what to say")
    s.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT,
                   help="WAV file to write (default: %(default)s)")
    s.add_argument("--overwrite", "--force", action="store_true",
                   help="replace the output file if it exists (default: refuse)")
    s.add_argument("--model", default="tiny",
                   help="preset (tiny, s2-pro: random weights), checkpoint directory or Hub id "
                   "org/name[@revision] (fetched into the Hub cache when not there; "
                   "default: %(default)s)")
    s.add_argument("--device", default="cpu",
                   help="torch device: cpu, cuda, cuda:N (default: %(default)s)")
    s.add_argument("--reference", type=Path,
                   help="reference clip to clone the voice from (default: none, the model's "
                   "own voice)")
    s.add_argument("--reference-text",
                   help="transcript of the reference clip (required with --reference)")
    s.add_argument("--seed", type=int, default=0,
                   help="sampling seed, and the presets' weights seed (default: %(default)s)")
    s.add_argument("--max-frames", type=int, default=None,
                   help="cap on generated codec frames, 21.5 per second of audio (default: auto: "
                   "the server's segment budget for the text, 3x its expected duration; with "
                   "random weights, which never stop, its expected duration)")
    s.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=0.8,
                   help="nucleus sampling threshold (default: %(default)s)")
    s.add_argument("--top-k", type=int, default=30,
                   help="sample among the k likeliest tokens (default: %(default)s)")
    s.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (default: progress every 2 s, live on a terminal)")
    s.set_defaults(fn=_synth)
    i = sub.add_parser(
        "inspect", help="show what a checkpoint holds and how it will load (exit 1 on problems)",
        description="Print what a checkpoint holds and how it will be loaded — config summary, "
        "weight shards and parameter count against the S2-Pro preset, dtypes, tokenizer special "
        "ids, the codec's keys (loaded / rebuilt / ignored / missing), estimated GPU memory at "
        "bf16 and FP8 — without loading it. Exits 1 and names each problem when anything would "
        "fail to load.")
    i.add_argument("checkpoint", help="a checkpoint directory, or a Hub model id "
                   "(org/name[@revision]; fetched into the Hub cache when not there)")
    i.set_defaults(fn=_inspect)
    q = sub.add_parser(
        "quantize", help="write an FP8 copy of a checkpoint (e4m3, 128x128 block scales)",
        description="Write an FP8 copy of CHECKPOINT to OUTPUT: the transformer layers' linears "
        "(slow and fast AR) as float8_e4m3fn with one float32 scale per 128x128 block "
        "(`.weight_scale_inv` beside each `.weight`, Hugging Face's fine-grained fp8 layout, "
        "announced in config.json's quantization_config); embeddings, norms and output heads "
        "stay bf16; tokenizer and codec files are copied. Serve it with --dtype fp8 (with "
        "another dtype its linears are dequantised at load).")
    q.add_argument("checkpoint", type=Path, help="a bf16 checkpoint directory")
    q.add_argument("output", type=Path, help="directory to write (must be empty, or --overwrite)")
    q.add_argument("--keep", default="",
                   help="layers to keep in bf16: comma-separated fnmatch patterns of module "
                   "names, e.g. 'layers.34.attention.wo,layers.*.feed_forward.w2'")
    q.add_argument("--device", default="cpu",
                   help="where to quantise: cpu, cuda, ... (default: %(default)s)")
    q.add_argument("--overwrite", action="store_true", help="replace OUTPUT's weights")
    q.set_defaults(fn=_quantize)
    g = sub.add_parser(
        "fp8-gate", add_help=False,
        help="the FP8 correctness gate: greedy FP8 == bf16 for 5 frames, logit error bound "
        "(rtvoice fp8-gate --help)",
        description="Run engine.fp8_gate (its own options follow).")
    g.add_argument("gate_args", nargs=argparse.REMAINDER)
    g.set_defaults(fn=_fp8_gate)
    try:
        from .server_cli import add_serve_parser
    except ImportError:  # the service module is optional until it lands
        pass
    else:
        add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fp8-gate"]:  # its options are engine.fp8_gate's own
        from engine.fp8_gate import main as gate

        return gate(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"rtvoice {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
