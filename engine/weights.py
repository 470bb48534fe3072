"""Weights for the DualAR model: real S2 checkpoints (sharded safetensors) or dummy values.

Checkpoint key names (HF layout of S2-Pro) map onto our module tree:
  text_model.model.X                     -> X
  audio_decoder.codebook_embeddings.W    -> codebook_embeddings.W   (a slow-AR input table)
  audio_decoder.X                        -> fast_X                   (fast_layers.N..., fast_output...)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .config import ModelConfig
from .model import DualAR

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint does not match its config (names the tensor and what was expected)."""


def checkpoint_key_to_param(key: str) -> str | None:
    if key.startswith("text_model.model."):
        return key[len("text_model.model."):]
    if key == "audio_decoder.codebook_embeddings.weight":
        return "codebook_embeddings.weight"
    if key.startswith("audio_decoder."):
        return "fast_" + key[len("audio_decoder."):]
    return None


def param_to_checkpoint_key(name: str) -> str:
    if name == "codebook_embeddings.weight":
        return "audio_decoder.codebook_embeddings.weight"
    if name.startswith("fast_"):
        return "audio_decoder." + name[len("fast_"):]
    return "text_model.model." + name


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory: index-listed shards, or every *.safetensors."""
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(f for f in path.glob("*.safetensors") if f.name.startswith("model"))
    if not files:
        raise CheckpointError(f"no model*.safetensors (or index) in {path}")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, Tensor]]:
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                yield key, st.get_tensor(key)


def load_model(path: str | Path, cfg: ModelConfig | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.bfloat16) -> DualAR:
    """Load an S2 checkpoint directory (config.json + safetensors shards) into a DualAR."""
    path = Path(path)
    cfg = cfg or ModelConfig.from_checkpoint(path)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = DualAR(cfg)
    expected = {n: p.shape for n, p in model.named_parameters()}
    state: dict[str, Tensor] = {}
    for key, tensor in iter_checkpoint(path):
        name = checkpoint_key_to_param(key)
        if name is None or name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r} in checkpoint {path} (not part of the "
                                  f"{cfg.name} model described by its config.json)")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {key!r} has shape {tuple(tensor.shape)} but config.json "
                                  f"implies {tuple(expected[name])}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        keys = ", ".join(param_to_checkpoint_key(m) for m in missing[:5])
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors: {keys}"
                              + (" ..." if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    log.info("loaded %s (%.2fB params, %s) from %s in %.1fs", cfg.name, cfg.num_params() / 1e9,
             dtype, path, time.perf_counter() - t0)
    return model.eval().requires_grad_(False)


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def dummy_model(cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.bfloat16) -> DualAR:
    """Deterministic random weights at any size (for tests and benchmarks).

    Scales mimic a trained checkpoint: matrices and embeddings N(0, 0.02^2), RMSNorm
    weights 1 + N(0, 0.1^2). Each tensor has its own seed (from `seed` and its name), so
    values do not depend on creation order; they do depend on the device's generator.
    """
    with torch.device("meta"):
        model = DualAR(cfg)
    device = torch.device(device)
    state = {}
    for name, p in model.named_parameters():
        g = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
        t = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32
                        if device.type == "cpu" else dtype)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        else:
            t = 0.02 * t
        state[name] = t.to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)


def save_checkpoint(model: DualAR, path: str | Path, *, shard_bytes: int = 2 << 30) -> None:
    """Write config.json + sharded safetensors + index with the real S2 key names."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, p in model.state_dict().items():
        nbytes = p.numel() * p.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][param_to_checkpoint_key(name)] = p.detach().contiguous().cpu()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=2))
