"""What a checkpoint holds and how it will be loaded, without loading it: the config, the
weight shards (parameter count against the config and the S2-Pro preset, dtypes, keys that
are missing, unexpected or mis-shaped), the tokenizer's special ids, the codec's keys grouped
the way the loader treats them, and the GPU memory it needs. `rtvoice inspect` prints it;
every problem that would stop a load is listed in `Report.problems`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .codec import CodecConfig, codec_keys, fold_weight_norm, read_checkpoint
from .codec.model import Codec
from .config import EngineConfig, ModelConfig, preset
from .loader import checkpoint_dir, reconcile_ids
from .model import DualAR
from .quant import scale_shape
from .tokenizer import HFTokenizer
from .weights import (
    SCALE_SUFFIX,
    checkpoint_key_to_param,
    param_to_checkpoint_key,
    safetensors_files,
)

__all__ = ["Report", "inspect_checkpoint"]

GIB = 2**30
FP8_BLOCK = 128  # the FP8 path's 128 x 128 weight-scale blocks (one fp32 scale each)


@dataclass(slots=True)
class Report:
    path: Path | None = None
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, title: str, lines: list[str]) -> None:
        self.sections.append((title, lines))

    def text(self) -> str:
        out = []
        for title, lines in self.sections:
            out.append(f"{title}:")
            out += [f"  {line}" for line in lines]
        out.append("problems:" if self.problems else "problems: none, it loads")
        out += [f"  - {p}" for p in self.problems]
        return "\n".join(out)


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def _names(keys: list[str], most: int = 6) -> str:
    return ", ".join(keys[:most]) + (f" ... ({len(keys)} in all)" if len(keys) > most else "")


def inspect_checkpoint(spec: str) -> Report:
    """Inspect a checkpoint directory or a Hub model id (fetched when not cached)."""
    report = Report()
    try:
        path = checkpoint_dir(spec)
    except FileNotFoundError as e:
        report.problems.append(str(e))
        return report
    report.path = path
    report.add("checkpoint", [str(path)] + ([f"Hub id {spec}"] if str(path) != spec else []))
    try:
        cfg = ModelConfig.from_checkpoint(path)
    except (FileNotFoundError, ValueError, json.JSONDecodeError, KeyError, TypeError) as e:
        report.problems.append(f"config.json: {e}")
        cfg = None
    if cfg is not None:
        _config(report, cfg)
    tok = _tokenizer(report, path, cfg)
    if cfg is not None:
        if tok is not None:
            cfg = reconcile_ids(cfg, tok)
        params = _weights(report, path, cfg)
        codec_params = _codec(report, path)
        _memory(report, cfg, params, codec_params)
    return report


def _config(report: Report, cfg: ModelConfig) -> None:
    s, f = cfg.slow, cfg.fast
    same = (s, f, cfg.num_codebooks) == (preset("s2-pro").slow, preset("s2-pro").fast, 10)
    report.add("config", [
        f"slow AR: {s.n_layer} layers, dim {s.dim}, {s.n_head} heads ({s.n_local_heads} kv) of "
        f"{s.head_dim}, FFN {s.intermediate_size}, vocab {s.vocab_size}, context "
        f"{s.max_seq_len}, q/k norm {s.qk_norm}",
        f"fast AR: {f.n_layer} layers, dim {f.dim}, {f.n_head} heads ({f.n_local_heads} kv) of "
        f"{f.head_dim}, FFN {f.intermediate_size}, {cfg.num_codebooks} codebooks of "
        f"{cfg.codebook_size}",
        f"ids in config.json: <|im_end|> {cfg.ids.im_end}, semantic "
        f"{cfg.ids.semantic_start}..{cfg.ids.semantic_end}",
        "shapes: the S2-Pro preset's" if same else "shapes: not S2-Pro's (a custom size)",
    ])


def _tokenizer(report: Report, path: Path, cfg: ModelConfig | None):  # type: ignore[no-untyped-def]
    try:
        tok = HFTokenizer(path)
    except Exception as e:  # missing file, parse error (old tokenizers), not an S2 tokenizer
        report.problems.append(f"tokenizer.json: {e}")
        return None
    ids = tok.ids
    lines = [f"vocab {tok.vocab_size}; <|im_end|> {ids.im_end}, <|pad|> {ids.pad}, "
             f"<|audio_pad|> {ids.audio_pad}, <|semantic:0..4095|> "
             f"{ids.semantic_start}..{ids.semantic_end}"]
    if cfg is not None and (ids.semantic_start, ids.im_end) != (cfg.ids.semantic_start,
                                                                cfg.ids.im_end):
        lines.append("differs from config.json's ids: the tokenizer's are used (as the "
                     "reference does)")
    if cfg is not None and ids.semantic_end >= cfg.slow.vocab_size:
        report.problems.append(f"the tokenizer's semantic ids reach {ids.semantic_end}, past the "
                               f"model's vocabulary of {cfg.slow.vocab_size}")
    report.add("tokenizer", lines)
    return tok


def _weights(report: Report, path: Path, cfg: ModelConfig) -> int:
    from safetensors import safe_open

    try:
        files = safetensors_files(path)
    except ValueError as e:
        report.problems.append(str(e))
        return 0
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in DualAR(cfg).named_parameters()}
    seen: dict[str, tuple[int, ...]] = {}
    dtypes: Counter[str] = Counter()
    unexpected, misshaped = [], []
    scales: dict[str, tuple[int, ...]] = {}  # FP8 layers: weight name -> its scales' shape
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                shape = tuple(sl.get_shape())
                dtypes[str(sl.get_dtype())] += 1
                if key.endswith(SCALE_SUFFIX):
                    name = checkpoint_key_to_param(key[: -len(SCALE_SUFFIX)] + ".weight")
                    if name is None or name not in expected:
                        unexpected.append(key)
                    else:
                        scales[name] = shape
                    continue
                name = checkpoint_key_to_param(key)
                if name is None or name not in expected:
                    unexpected.append(key)
                elif shape != expected[name]:
                    misshaped.append(f"{key}: {list(shape)} in the checkpoint, config.json "
                                     f"implies {list(expected[name])}")
                    seen[name] = ()  # present (named above), not missing; counts no parameter
                else:
                    seen[name] = shape
    for name, shape in scales.items():
        want = scale_shape(*expected[name])
        if shape != want:
            misshaped.append(f"{param_to_checkpoint_key(name)[: -len('.weight')]}"
                             f"{SCALE_SUFFIX}: {list(shape)} in the checkpoint; FP8 block "
                             f"scales of a {list(expected[name])} weight are {list(want)} "
                             "(one per 128 x 128 block, row-major)")
    missing = [param_to_checkpoint_key(n) for n in expected if n not in seen]
    count = sum(int(torch.Size(s).numel()) for s in seen.values() if s)
    found = sum(1 for s in seen.values() if s)
    size = sum(f.stat().st_size for f in files)
    lines = [f"{len(files)} file(s), {_size(size)}: " + _names([f.name for f in files], 4),
             f"{found} of {len(expected)} tensors, {count:,} parameters (config.json implies "
             f"{cfg.num_params():,}; the S2-Pro preset has {preset('s2-pro').num_params():,})",
             "dtypes: " + ", ".join(f"{d} x{n}" for d, n in dtypes.most_common())]
    if scales:
        lines.append(f"FP8: {len(scales)} linears stored as e4m3 with 128 x 128 block scales "
                     "(serve with --dtype fp8; other dtypes dequantise them at load)")
    report.add("weights", lines)
    if unexpected:
        report.problems.append(f"unexpected model tensors (not in the model config.json "
                               f"describes): {_names(unexpected)}")
    if misshaped:
        report.problems += misshaped[:8]
    if missing:
        report.problems.append(f"missing model tensors: {_names(missing)}")
    return count


def _codec(report: Report, path: Path) -> int:
    weights = next((path / n for n in ("codec.safetensors", "codec.pth")
                    if (path / n).is_file()), None)
    if weights is None:
        report.problems.append(f"no codec.safetensors or codec.pth in {path}")
        return 0
    cfg_file = path / "codec_config.json"
    try:
        cfg = CodecConfig.from_file(cfg_file) if cfg_file.is_file() else CodecConfig.preset("s2-pro")
        raw = read_checkpoint(weights)
        # shapes only: fold the weight-norm pairs on meta tensors, read nothing more
        sd = fold_weight_norm({k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                               for k, v in raw.items()})
        keys = codec_keys(sd, cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        report.problems.append(f"{weights.name}: {e}")
        return 0
    with torch.device("meta"):
        n = sum(p.numel() for p in Codec(cfg).parameters())
    report.add("codec", [
        f"{weights.name}, {_size(weights.stat().st_size)}; config "
        + (cfg_file.name if cfg_file.is_file() else "the S2-Pro default (no codec_config.json)"),
        f"loaded: {len(keys.loaded)} tensors ({n:,} parameters)",
        f"rebuilt at load (skipped): {len(keys.rebuilt)}" + (f": {_names(keys.rebuilt)}"
                                                            if keys.rebuilt else ""),
        f"ignored (skipped with a warning): {len(keys.ignored)}"
        + (f": {_names(keys.ignored)}" if keys.ignored else ""),
        f"missing: {len(keys.missing)}, mis-shaped: {len(keys.misshaped)}",
    ])
    report.problems += keys.problems[:8]
    return int(n)


def _memory(report: Report, cfg: ModelConfig, params: int, codec_params: int) -> None:
    if not params:
        return
    s = cfg.slow
    # linears that FP8 would hold at a byte each (+ a float32 scale per 128 x 128 block);
    # embeddings, norms and the codebook tables stay bf16
    linear = sum(t.n_layer * (t.dim * (t.q_size + 2 * t.kv_size) + t.q_size * t.dim
                              + 3 * t.dim * t.intermediate_size) for t in (cfg.slow, cfg.fast))
    bf16 = 2 * params
    fp8 = 2 * (params - linear) + linear + 4 * linear // (FP8_BLOCK * FP8_BLOCK)
    kv_pos = 2 * s.n_layer * s.n_local_heads * s.head_dim * 2  # k and v, bf16
    codec = 2 * codec_params
    reserve = EngineConfig().kv_reserve_gib  # what the engine keeps out of the KV pool
    report.add("GPU memory (estimate)", [
        f"weights: {_size(bf16)} bf16, {_size(fp8)} FP8 (128x128 block-scaled linears); "
        f"codec {_size(codec)} bf16",
        f"KV cache: {kv_pos / 1024:.1f} KiB per position = {_size(kv_pos * 4096)} per session "
        f"of 4,096 positions; 64 sessions {_size(64 * kv_pos * 4096)}",
        f"with 64 sessions, plus the engine's {reserve:g} GiB reserve (--kv-reserve-gib): "
        f"{(bf16 + codec + 64 * kv_pos * 4096) / GIB + reserve:.1f} GiB bf16, "
        f"{(fp8 + codec + 64 * kv_pos * 4096) / GIB + reserve:.1f} GiB FP8",
    ])
