"""Build everything a service needs from one model spec: weights, tokenizer, codec.

Specs: a preset name (`tiny`, `s2-pro`) with dummy weights, a checkpoint directory holding
config.json, model*.safetensors (+ index), tokenizer.json and the codec (codec.pth or
codec.safetensors, with codec_config.json when it is not the real size), or a Hub model id
(`org/name[@revision]`), fetched through huggingface_hub into its cache (engine/hub.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .codec import Codec, CodecConfig, dummy_codec, load_codec
from .config import DTYPE_NAMES, PRECISION_NAMES, PRESETS, ModelConfig, preset
from .fusion import pack_ffn
from .hub import parse_repo_id, resolve
from .model import DualAR
from .quant import quantize_model
from .tokenizer import ByteTokenizer, HFTokenizer, PieceTokenizer, Tokenizer
from .weights import dummy_model, load_model

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES


@dataclass(slots=True)
class Bundle:
    model: DualAR
    tokenizer: Tokenizer
    codec: Codec
    name: str
    random_weights: bool


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def parse_precision(name: str | torch.dtype | None, device: str) -> tuple[torch.dtype, bool]:
    """A model dtype name -> (the activations' and unquantised weights' dtype, FP8 linears?).
    'fp8' keeps the device's default dtype for everything but the transformer linears."""
    if isinstance(name, str) and name.lower() == "fp8":
        return default_dtype(device), True
    if isinstance(name, str) and name.lower() not in PRECISION_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(PRECISION_NAMES)}")
    return (parse_dtype(name) if name is not None else default_dtype(device)), False


def default_dtype(device: str) -> torch.dtype:
    # bf16 matmuls are slow on most CPUs; fp32 there, bf16 on accelerators.
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def reconcile_ids(cfg: ModelConfig, tok: Tokenizer) -> ModelConfig:
    """The reference takes the semantic range and <|im_end|> from the tokenizer, whatever
    config.json says: so do we (with a warning when they differ)."""
    if (tok.ids.semantic_start, tok.ids.im_end) == (cfg.ids.semantic_start, cfg.ids.im_end):
        return cfg
    log.warning("tokenizer ids %s differ from config.json's %s; the tokenizer wins (as in the "
                "reference)", tok.ids, cfg.ids)
    return replace(cfg, ids=tok.ids)


def checkpoint_dir(spec: str) -> Path:
    """A checkpoint directory, or a Hub model id's snapshot (downloaded when not cached)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if parse_repo_id(spec) is not None:
        return resolve(spec)
    raise FileNotFoundError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}), a "
                            "checkpoint directory nor a Hub model id (org/name[@revision])")


def preset_tokenizer(spec: str, special_base: int) -> Tokenizer:
    """A random-weight preset's tokenizer: the fixtures' byte tokenizer for `tiny`; BPE-like
    prompt lengths for the others (what the benches' prefill costs depend on)."""
    if spec == "tiny":
        return ByteTokenizer(special_base=special_base)
    return PieceTokenizer(special_base=special_base)


def load_bundle(spec: str = "tiny", *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                codec_dtype: str | torch.dtype | None = None, seed: int = 0,
                max_seq_len: int | None = None, fp8_keep: tuple[str, ...] = ()) -> Bundle:
    """dtype: bf16/fp16/fp32, or fp8 (the transformer layers' linears in FP8 with 128 x 128
    block scales, the rest in the device's default dtype; `fp8_keep` names layers to keep in
    bf16). codec_dtype defaults to float32 on a CPU, bfloat16 on a GPU (the full-size codec
    decoder is ~150 GFLOP per second of audio; bf16 is what keeps 64 streams ahead of real
    time there)."""
    dt, fp8 = parse_precision(dtype, device)
    if fp8_keep and not fp8:
        raise ValueError("fp8_keep names layers to keep out of FP8; it needs dtype fp8")
    cdt = parse_dtype(codec_dtype) if codec_dtype is not None else default_dtype(device)
    if spec in PRESETS:
        cfg = preset(spec)
        if max_seq_len:
            cfg = cfg.with_max_seq_len(max_seq_len)
        model = dummy_model(cfg, seed=seed, device=device, dtype=dt)
        if fp8:
            quantize_model(model, keep=fp8_keep)
        tok = preset_tokenizer(spec, cfg.ids.semantic_start - 35)
        codec = dummy_codec(CodecConfig.preset(spec), seed=seed, device=device, dtype=cdt)
        log.info("model %s: deterministic random weights (seed %d) — it exercises the whole "
                 "pipeline but does not speak; pass a checkpoint directory for real speech", spec, seed)
        return _packed(Bundle(model, tok, codec, spec, True))
    path = checkpoint_dir(spec)
    cfg = ModelConfig.from_checkpoint(path)
    if max_seq_len:
        cfg = cfg.with_max_seq_len(max_seq_len)
    tok = HFTokenizer(path)
    cfg = reconcile_ids(cfg, tok)
    model = load_model(path, cfg, device=device, dtype=dt, fp8=fp8, fp8_keep=fp8_keep)
    codec = load_codec(path, device=device, dtype=cdt)
    name = path.name if Path(spec).expanduser().is_dir() else spec  # a Hub id: as given
    return _packed(Bundle(model, tok, codec, name, False))


def _packed(bundle: Bundle) -> Bundle:
    """The bundle with every SwiGLU FFN's W1 | W3 laid out as one buffer (fusion.pack_ffn:
    same values; the compiled ops run each as one GEMM), done here, once: packing re-lays
    the weights, and a CUDA graph an engine captured before a later engine packed them
    would replay over the freed storage."""
    pack_ffn(bundle.model)
    pack_ffn(bundle.codec)
    return bundle
