"""Weights for the DualAR model: real S2 checkpoints (sharded safetensors) or dummy values.

Checkpoint key names (HF layout of S2-Pro) map onto our module tree:
  text_model.model.X                     -> X
  audio_decoder.codebook_embeddings.W    -> codebook_embeddings.W   (a slow-AR input table)
  audio_decoder.X                        -> fast_X                   (fast_layers.N..., fast_output...)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .config import ModelConfig
from .functional import param_seed
from .model import DualAR
from .quant import (
    BLOCK,
    FP8,
    Fp8Linear,
    Fp8Weight,
    check_fp8_values,
    dequantize_fp8,
    fp8_layers,
    quantisable,
    quantize_model,
    scale_shape,
)

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


SCALE_SUFFIX = ".weight_scale_inv"  # an FP8 linear's block scales, beside its ".weight"


def checkpoint_keys(path: Path) -> list[str]:
    keys: list[str] = []
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            keys.extend(st.keys())
    return keys


def _fp8_modules(keys: list[str]) -> set[str]:
    """Module names (ours) of the linears a checkpoint holds in FP8."""
    out = set()
    for key in keys:
        if key.endswith(SCALE_SUFFIX):
            name = checkpoint_key_to_param(key[: -len(SCALE_SUFFIX)] + ".weight")
            if name is not None:
                out.add(name[: -len(".weight")])
    return out


def load_model(path: str | Path, cfg: ModelConfig | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
               fp8_keep: tuple[str, ...] = ()) -> DualAR:
    """Load an S2 checkpoint directory (config.json + safetensors shards) into a DualAR.

    `fp8`: the transformer layers' linears in FP8 (engine/quant.py): kept as stored when the
    checkpoint is already quantised (`rtvoice quantize`), quantised here otherwise (except
    layers matching `fp8_keep`). Without it, an FP8 checkpoint's linears are dequantised to
    `dtype`. `dtype` is everything else's (and the activations') dtype."""
    path = Path(path)
    cfg = cfg or ModelConfig.from_checkpoint(path)
    t0 = time.perf_counter()
    stored_fp8 = _fp8_modules(checkpoint_keys(path))
    if stored_fp8 and fp8_keep:
        raise CheckpointError(f"{path} is already quantised to FP8; the layers it keeps in bf16 "
                              "were chosen by `rtvoice quantize --keep` (re-quantise from the "
                              "bf16 checkpoint to change them)")
    with torch.device("meta"):
        model = DualAR(cfg)
        if fp8:  # the stored FP8 layers load as they are
            for name in stored_fp8:
                parent, _, leaf = name.rpartition(".")
                lin = model.get_submodule(name)
                n, k = lin.weight.shape
                model.get_submodule(parent).register_module(leaf, Fp8Linear(
                    torch.empty(n, k, dtype=FP8), torch.empty(scale_shape(n, k))))
    expected = {n: p.shape for n, p in model.state_dict().items()}
    state: dict[str, Tensor] = {}
    pending: dict[str, dict[str, Tensor]] = {}  # FP8 weights waiting for their scales (or back)
    for key, tensor in iter_checkpoint(path):
        is_scale = key.endswith(SCALE_SUFFIX)
        name = checkpoint_key_to_param(key[: -len(SCALE_SUFFIX)] + ".weight" if is_scale else key)
        module = name[: -len(".weight")] if name and name.endswith(".weight") else None
        if module in stored_fp8:
            if fp8:  # kept in FP8: the values as `qweight`, the scales as `weight_scale_inv`
                name = module + (".weight_scale_inv" if is_scale else ".qweight")
            else:
                part = pending.setdefault(module, {})
                part["scale" if is_scale else "q"] = tensor
                if len(part) < 2:
                    continue
                fw = Fp8Weight(part["q"], part["scale"].float())
                try:
                    fw.check()
                    check_fp8_values(fw.q, fw.scale)
                except ValueError as e:
                    raise CheckpointError(f"{path}: {param_to_checkpoint_key(module + '.weight')}: "
                                          f"{e}") from None
                tensor = dequantize_fp8(fw, dtype)
                del pending[module]
        elif is_scale:
            raise CheckpointError(f"unexpected tensor {key!r} in checkpoint {path}")
        if name is None or name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r} in checkpoint {path} (not part of the "
                                  f"{cfg.name} model described by its config.json)")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {key!r} has shape {tuple(tensor.shape)} but config.json "
                                  f"implies {tuple(expected[name])}")
        if name.endswith(".qweight"):
            if tensor.dtype != FP8:
                raise CheckpointError(f"tensor {key!r} of an FP8 layer is {tensor.dtype}, not "
                                      "float8_e4m3fn")
            state[name] = tensor.to(device=device)
        elif name.endswith(".weight_scale_inv"):
            state[name] = tensor.to(device=device, dtype=torch.float32)
        else:
            state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        keys = ", ".join(param_to_checkpoint_key(m) for m in missing[:5])
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors: {keys}"
                              + (" ..." if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    for mod_name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            try:
                m.weight.check()
                check_fp8_values(m.weight.q, m.weight.scale,
                                 param_to_checkpoint_key(mod_name + ".weight"))
            except ValueError as e:
                raise CheckpointError(f"{path}: {e}") from None
    if fp8 and not stored_fp8:
        quantize_model(model, keep=fp8_keep)
    log.info("loaded %s (%.2fB params, %s%s) from %s in %.1fs", cfg.name, cfg.num_params() / 1e9,
             dtype, f", {len(fp8_layers(model))} FP8 linears" if fp8 else "", path,
             time.perf_counter() - t0)
    return model.eval().requires_grad_(False)


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
        g = torch.Generator(device=device).manual_seed(param_seed(seed, name))
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


def checkpoint_state(model: DualAR) -> dict[str, Tensor]:
    """The model's tensors under their S2 checkpoint names; an FP8 linear's values are its
    `.weight` (float8_e4m3fn) and its block scales `.weight_scale_inv` (float32)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(".qweight"):
            key = param_to_checkpoint_key(name[: -len(".qweight")] + ".weight")
        elif name.endswith(".weight_scale_inv"):
            key = param_to_checkpoint_key(name[: -len(SCALE_SUFFIX)] + ".weight")
            key = key[: -len(".weight")] + SCALE_SUFFIX
        else:
            key = param_to_checkpoint_key(name)
        # .contiguous(): a view (a packed W1|W3 half, a transposed scale) is saved in its own
        # row-major order, never in its storage's
        out[key] = t.detach().contiguous().cpu()
    return out


def quantization_config(model: DualAR) -> dict[str, object] | None:
    """config.json's `quantization_config` for a model with FP8 linears (Hugging Face's
    fine-grained `fp8` method), naming the quantisable layers kept in bf16."""
    fp8 = fp8_layers(model)
    if not fp8:
        return None
    kept = [param_to_checkpoint_key(n + ".weight")[: -len(".weight")]
            for n in quantisable(model)]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": kept}


def save_checkpoint(model: DualAR, path: str | Path, *, shard_bytes: int = 2 << 30) -> None:
    """Write config.json + sharded safetensors + index with the real S2 key names (FP8 layers
    as e4m3 values + float32 block scales, announced in config.json)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.cfg.to_dict()
    quant = quantization_config(model)
    if quant is not None:
        config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in checkpoint_state(model).items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=2))


def quantize_checkpoint(src: str | Path, out: str | Path, *, keep: tuple[str, ...] = (),
                        device: str = "cpu", overwrite: bool = False) -> dict[str, object]:
    """An FP8 copy of checkpoint directory `src` in `out`: the transformer layers' linears as
    e4m3 + 128 x 128 block scales (except `keep` patterns), everything else as stored in
    bf16; the tokenizer, codec and other files copied as they are."""
    import shutil

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a checkpoint directory")
    if out.resolve() == src.resolve():
        raise ValueError("the FP8 copy must go to another directory than its source")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    if _fp8_modules(checkpoint_keys(src)):
        raise ValueError(f"{src} is already quantised to FP8")
    model = load_model(src, device=device, dtype=torch.bfloat16, fp8=True, fp8_keep=keep)
    weights = {f.name for f in safetensors_files(src)} | {"model.safetensors.index.json",
                                                          "config.json"}
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):
        old.unlink()
    for f in src.iterdir():
        if f.name not in weights and f.is_file():
            shutil.copy2(f, out / f.name)
    # config.json: the source's own (keys we do not model kept), plus the quantisation
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(model)
    save_checkpoint(model, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    n = len(fp8_layers(model))
    return {"output": str(out), "fp8_layers": n, "kept": len(quantisable(model)),
            "bytes": sum(f.stat().st_size for f in out.glob("model*.safetensors"))}
