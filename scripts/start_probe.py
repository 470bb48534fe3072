"""Where the server's start goes before the engine: the seconds to import torch, initialise
the device, import the service, and draw a random-weight model preset and its codec (one
process). `python scripts/start_probe.py [--model s2-pro] [--device cuda]`."""

from __future__ import annotations

import argparse
import json
import time

t0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="s2-pro")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    out = {"import_torch_s": IMPORT_TORCH_S}
    cuda = args.device == "cuda"

    def timed(key: str, fn):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        r = fn()
        if cuda:
            torch.cuda.synchronize()
        out[key] = time.perf_counter() - t
        return r

    timed("device_init_s", lambda: torch.zeros(1, device=args.device))
    timed("import_service_s", lambda: __import__("rtvoice.app"))
    from engine.codec import CodecConfig, dummy_codec
    from engine.loader import preset
    from engine.weights import dummy_model

    dt = torch.bfloat16 if cuda else torch.float32
    timed("dummy_model_s", lambda: dummy_model(preset(args.model), device=args.device, dtype=dt))
    timed("dummy_codec_s", lambda: dummy_codec(CodecConfig.preset(args.model),
                                               device=args.device, dtype=dt))
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
