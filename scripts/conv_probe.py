"""cuDNN's choice for the codec's convolutions: time the streaming tick's conv shapes (64
streams x 8 frames), channels-first (conv1d) and channels-last (NHWC conv2d, the engine's
layout), with cudnn.benchmark off or on (argv[1]: 0 off, 1 on, L<n> on with at most n
algorithms tried per shape (cudnn.benchmark_limit); run each in a fresh process: plans are
cached per shape; `first_s` is the plan's choice, the autotuner's trials included), then the
graphed codec with the same setting for its capture (`capture_s`) and its ticks (argv[2] =
"convs": the conv shapes only; "buckets": no conv rows, and every captured bucket's tick
timed against the audio it makes, with the torch Snake formulas so that csrc's extension
need not be built: a bucket slower than realtime would stall a server's streams).

    python scripts/conv_probe.py 0; python scripts/conv_probe.py L3; python scripts/conv_probe.py 1
    python scripts/conv_probe.py L3 buckets
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

mode = sys.argv[1]
bench = mode != "0"
torch.backends.cudnn.benchmark = bench
if mode.startswith("L"):
    torch.backends.cudnn.benchmark_limit = int(mode[1:])
dt = torch.bfloat16
out = {"benchmark": bench, "benchmark_limit": torch.backends.cudnn.benchmark_limit}
def timed(fn) -> dict:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0  # the plan's choice (the autotuner's trials) included
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return {"ms": round(e0.elapsed_time(e1) / 10, 3), "first_s": round(first, 2)}


mode2 = sys.argv[2] if len(sys.argv) > 2 else ""
SHAPES = ((64, 384, 2048, 9), (64, 384, 2048, 3), (64, 384, 2048, 1), (64, 768, 256, 9),
          (64, 192, 8192, 9), (64, 96, 16384, 9), (16, 384, 1024, 9), (32, 384, 512, 9),
          (65, 384, 2048, 9))
for B, C, T, d in () if mode2 == "buckets" else SHAPES:
    x = torch.randn(B, C, T + 6 * d, device="cuda", dtype=dt)
    w = torch.randn(C, C, 7, device="cuda", dtype=dt) / 30
    b = torch.randn(C, device="cuda", dtype=dt)
    # channels-first conv1d (cuDNN transposes to NHWC and back), and the engine's layout:
    # an NHWC conv2d over channels-last activations (engine/codec/layers.py conv_cl)
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    key = f"{B}x{C}x{T}_d{d}"
    out[key] = timed(lambda x=x, w=w, b=b, d=d: F.conv1d(x, w, b, dilation=d))
    out[key + "_channels_last"] = timed(
        lambda x4=x4, w4=w4, b=b, d=d: F.conv2d(x4, w4, b, dilation=(1, d)))
print(json.dumps(out), flush=True)
if mode2 != "convs":  # the graphed codec: heuristic vs tuned plans
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec
    from engine.codec.layers import CodecOps
    from engine.ops import build_ops

    codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device="cuda", dtype=dt)
    dec = StreamingDecoder(codec, max_streams=64, buckets=True, max_frames=4096,
                           ops=CodecOps(channels_last=True) if mode2 == "buckets"
                           else build_ops("cuda").codec)
    # as the engine runs it: capture() autotunes the buckets of AUTOTUNE_MIN_WORK stream-
    # frames and more (at most AUTOTUNE_LIMIT algorithms each: modes 1 and L<n> differ in the conv
    # rows only), the others keep cuDNN's heuristic plans
    torch.backends.cudnn.benchmark = False
    if not bench:  # heuristic plans for every bucket
        dec.AUTOTUNE_MIN_WORK = 1 << 30
    from gpu_bench import codec_tick  # this script's folder is on sys.path

    keys = dec.bucket_keys() if mode2 == "buckets" else [(16, 4), (64, 8), (64, 2), (1, 2)]
    only = os.environ.get("STREAMS", "") if mode2 == "buckets" else ""  # e.g. STREAMS=1,8,16
    if only:  # these stream buckets only (every frame bucket of each: a pass needs them all)
        keys = [k for k in keys if str(k[0]) in only.split(",")]
    res: dict = {"capture_s": round(dec.capture(keys=keys if only else None), 1)}
    for streams, frames in keys:
        res[f"graphs_{streams}x{frames}"] = tick = codec_tick(
            dec, streams, frames, n=3 if mode2 == "buckets" else 5)
        tick["behind_realtime"] = tick["x_realtime"] < streams  # slower than its audio
    if mode2 == "buckets":
        res["behind_realtime"] = [k for k, v in res.items() if isinstance(v, dict)
                                  and v["behind_realtime"]]
    print(json.dumps(res), flush=True)
