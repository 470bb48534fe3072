"""cuDNN's choice for the codec's convolutions: time the streaming tick's conv shapes (64
streams x 8 frames) with cudnn.benchmark off or on (argv[1] = 0/1; run each in a fresh
process: plans are cached per shape), then, with the autotuner on, the graphed codec.

    python scripts/conv_probe.py 0; python scripts/conv_probe.py 1
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

bench = sys.argv[1] == "1"
torch.backends.cudnn.benchmark = bench
dt = torch.bfloat16
out = {"benchmark": bench}
for B, C, T, d in ((64, 384, 2048, 9), (64, 384, 2048, 3), (64, 384, 2048, 1), (64, 768, 256, 9),
                   (64, 192, 8192, 9), (64, 96, 16384, 9), (16, 384, 1024, 9), (32, 384, 512, 9),
                   (65, 384, 2048, 9)):
    x = torch.randn(B, C, T + 6 * d, device="cuda", dtype=dt)
    w = torch.randn(C, C, 7, device="cuda", dtype=dt) / 30
    b = torch.randn(C, device="cuda", dtype=dt)
    t0 = time.perf_counter()
    F.conv1d(x, w, b, dilation=d)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        F.conv1d(x, w, b, dilation=d)
    e1.record()
    torch.cuda.synchronize()
    out[f"{B}x{C}x{T}_d{d}"] = {"ms": round(e0.elapsed_time(e1) / 10, 3), "first_s": round(first, 2)}
print(json.dumps(out), flush=True)
if bench:
    from engine.codec import CodecConfig, StreamingDecoder, dummy_codec
    from engine.ops import build_ops

    codec = dummy_codec(CodecConfig.preset("s2-pro"), seed=0, device="cuda", dtype=dt)
    dec = StreamingDecoder(codec, max_streams=64, buckets=True, max_frames=4096,
                           ops=build_ops("cuda").codec)
    from gpu_bench import codec_tick  # this script's folder is on sys.path

    res: dict = {"capture_s": round(dec.capture(), 1)}
    for streams, frames in ((16, 4), (64, 8), (64, 2), (1, 2)):
        res[f"graphs_{streams}x{frames}"] = codec_tick(dec, streams, frames)
    print(json.dumps(res), flush=True)
