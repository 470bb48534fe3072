"""Loading codec checkpoints and making deterministic dummy weights.

Checkpoint forms accepted by :func:`load_codec`:

- ``codec.safetensors`` (the fixtures): keys = the codec module's state dict;
- ``codec.pth`` (the real S2 checkpoint): a torch pickle read with ``weights_only=True``
  (memory-mapped where the file allows, so tensors never used are never read); may be
  ``{"state_dict": {...}}``; when keys carry a ``generator.`` prefix only those are kept (the
  reference loader does the same) and the prefix is stripped.

Loaded the way the reference loads it (``strict=False``): buffers the codec rebuilds at load
(causal masks, RoPE tables, KV caches: ``REBUILT_SUFFIXES``) are skipped by name, and any
other unexpected tensor is skipped with one warning listing them. A missing, mis-shaped or
non-float weight is an error naming the tensor (and both shapes). ``codec_keys`` groups a
checkpoint's keys this way without loading anything (``rtvoice inspect``).

Weight norm is folded at load: ``X.parametrizations.weight.original0/original1`` (g/v, torch's
parametrization names) and ``X.weight_g/X.weight_v`` (the older names) become
``X.weight = torch._weight_norm(v, g, 0)`` -- the very kernel the reference runs every forward,
so folded weights are bit-identical to the reference's effective weights. For transposed convs
dim 0 is the input channel, which is what the reference normalises over.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..functional import param_seed
from .config import CodecConfig
from .layers import CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, LayerScale, RMSNorm, Snake1d
from .model import Codec
from .quantizer import VectorQuantizer

__all__ = ["REBUILT_SUFFIXES", "CodecKeys", "codec_keys", "dummy_codec", "fold_weight_norm",
           "load_codec", "read_checkpoint"]

log = logging.getLogger(__name__)

# Persistent buffers of the reference's transformers that the real codec.pth carries (bool
# causal masks of 16384^2 and 4096^2, bf16 RoPE tables) and KV caches: rebuilt here at load.
REBUILT_SUFFIXES = (".freqs_cis", ".causal_mask", ".kv_cache.k_cache", ".kv_cache.v_cache")

_WN_PAIRS = (
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


def read_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """Raw tensors of a ``.safetensors`` or torch-pickle (``.pth``/``.pt``/``.bin``) file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"codec weights not found: {p}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd: object = load_file(str(p), device="cpu")
    else:
        try:  # memory-mapped: the 1.9 GB real file is mostly buffers that are never read
            sd = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) pickle cannot be mapped
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    if isinstance(sd, Mapping) and "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping):
        raise ValueError(f"{p}: expected a mapping of tensors, got {type(sd).__name__}")
    if any(str(k).startswith("generator.") for k in sd):
        sd = {k[len("generator.") :]: v for k, v in sd.items() if str(k).startswith("generator.")}
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        if not isinstance(v, Tensor):
            raise ValueError(f"{p}: entry {k!r} is not a tensor ({type(v).__name__})")
        out[str(k)] = v
    return out


def fold_weight_norm(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Replace every weight-norm (g, v) pair by the plain ``weight`` (float32 math)."""
    out: dict[str, Tensor] = {}
    pending: dict[str, dict[str, Tensor]] = {}
    for k, v in sd.items():
        for g_suffix, v_suffix in _WN_PAIRS:
            if k.endswith(g_suffix) or k.endswith(v_suffix):
                is_g = k.endswith(g_suffix)
                base = k[: -len(g_suffix if is_g else v_suffix)]
                pending.setdefault(base + ".weight", {})["g" if is_g else "v"] = v
                pending[base + ".weight"]["_names"] = (base + g_suffix, base + v_suffix)  # type: ignore[assignment]
                break
        else:
            out[k] = v
    for name, parts in pending.items():
        g_name, v_name = parts["_names"]  # type: ignore[misc]
        if "g" not in parts:
            raise ValueError(f"weight-norm tensor {v_name!r} has no matching {g_name!r}")
        if "v" not in parts:
            raise ValueError(f"weight-norm tensor {g_name!r} has no matching {v_name!r}")
        g, v = parts["g"].float(), parts["v"].float()
        want = (v.shape[0],) + (1,) * (v.dim() - 1)
        if tuple(g.shape) != want:
            raise ValueError(
                f"weight-norm magnitude {g_name!r} has shape {list(g.shape)}, expected "
                f"{list(want)} for direction {v_name!r} of shape {list(v.shape)}"
            )
        if name in out:
            raise ValueError(f"checkpoint has both {name!r} and its weight-norm pair {g_name!r}")
        out[name] = torch._weight_norm(v, g, 0)
    return out


def _resolve(path: str | Path, cfg: CodecConfig | None) -> tuple[Path, CodecConfig]:
    p = Path(path)
    if p.is_dir():
        for name in ("codec.safetensors", "codec.pth"):
            if (p / name).is_file():
                weights = p / name
                break
        else:
            raise FileNotFoundError(f"{p}: no codec.safetensors or codec.pth")
        cfg_dir = p
    elif p.is_file():
        weights, cfg_dir = p, p.parent
    else:
        raise FileNotFoundError(f"codec path not found: {p}")
    if cfg is None:
        cfg_file = cfg_dir / "codec_config.json"
        # A real S2-Pro checkpoint directory ships codec.pth without a codec config: the real
        # sizes are the default (a mismatch is caught by the shape checks below).
        cfg = (
            CodecConfig.from_file(cfg_file) if cfg_file.is_file() else CodecConfig.preset("s2-pro")
        )
    return weights, cfg


@dataclass(slots=True)
class CodecKeys:
    """A codec checkpoint's tensors (after weight-norm folding) against the model's."""

    loaded: list[str] = field(default_factory=list)  # model weights found, right shape
    rebuilt: list[str] = field(default_factory=list)  # buffers rebuilt at load: skipped
    ignored: list[str] = field(default_factory=list)  # unknown: skipped with a warning
    missing: list[str] = field(default_factory=list)  # model weights not in the checkpoint
    # (name, checkpoint shape, model shape) of weights with the wrong shape
    misshaped: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    not_float: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """What stops the codec from loading, one line each (empty: it loads)."""
        return ([f"missing codec tensor {k!r}" for k in self.missing]
                + [f"codec tensor {k!r} has shape {got} in the checkpoint, the model (its codec "
                   f"config) expects {want}" for k, got, want in self.misshaped]
                + [f"codec tensor {k!r} is not a float tensor" for k in self.not_float])


def codec_keys(sd: Mapping[str, Tensor], cfg: CodecConfig) -> CodecKeys:
    """Group a folded codec state dict's keys against `cfg`'s model (nothing is loaded)."""
    with torch.device("meta"):
        expected = Codec(cfg).state_dict()
    keys = CodecKeys()
    for k, ref in expected.items():
        if k not in sd:
            keys.missing.append(k)
        elif tuple(sd[k].shape) != tuple(ref.shape):
            keys.misshaped.append((k, list(sd[k].shape), list(ref.shape)))
        elif not sd[k].dtype.is_floating_point:
            keys.not_float.append(k)
        else:
            keys.loaded.append(k)
    for k in sd:
        if k not in expected:
            (keys.rebuilt if k.endswith(REBUILT_SUFFIXES) else keys.ignored).append(k)
    return keys


def load_codec(
    path: str | Path,
    cfg: CodecConfig | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Codec:
    """Load a codec from a directory (``codec_config.json`` + ``codec.safetensors`` or
    ``codec.pth``) or a weights file. Returns an eval-mode :class:`Codec` on ``device``/``dtype``.

    Raises ValueError naming the tensor (and both shapes) on a missing, mis-shaped or
    non-float weight; unknown extra tensors are skipped with one warning.
    """
    weights, cfg = _resolve(path, cfg)
    sd = fold_weight_norm(read_checkpoint(weights))
    keys = codec_keys(sd, cfg)
    if keys.problems:
        more = f" ({len(keys.problems)} problems in all)" if len(keys.problems) > 1 else ""
        raise ValueError(f"{weights}: {keys.problems[0]}{more}")
    if keys.ignored:
        log.warning("%s: %d tensors the codec does not use were skipped (the reference loads "
                    "non-strictly too): %s", weights, len(keys.ignored),
                    ", ".join(keys.ignored[:12]) + (" ..." if len(keys.ignored) > 12 else ""))
    with torch.device("meta"):
        model = Codec(cfg)
    expected = model.state_dict()
    # The meta-device model takes the checkpoint tensors as its parameters (no second copy).
    model.load_state_dict({k: sd[k].float() for k in expected}, strict=True, assign=True)
    return model.requires_grad_(False).to(device=device, dtype=dtype).eval()


@torch.no_grad()
def dummy_codec(
    cfg: CodecConfig,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Codec:
    """Deterministic random weights with the fixture's scales (audio in [-1, 1], not saturated).

    Each tensor is drawn from its own generator on `device`, seeded from `seed` and its name
    (as `engine.weights.dummy_model` does): same seed, config and device give the same
    weights, and the 391 M parameters of the s2-pro codec take a fraction of a second on a
    GPU instead of seconds of sequential CPU draws (part of the server's start).
    Scales: weight-normed convs get unit-norm directions times g = 1 + N(0, 0.1^2) (x0.75 in
    the decoder); Snake alpha = |1 + N(0, 0.2^2)| + 0.1; codebooks N(0, 1); LayerScale and
    ConvNeXt gamma 0.3 + N(0, 0.05^2); norm weights 1 + N(0, 0.1^2); biases N(0, 0.02^2); other
    conv/linear weights N(0, 1/fan_in); the decoder's last conv at half gain. Measured audio
    std: ~0.4 (tiny), ~0.3 (s2-pro), with <0.1% of pre-tanh samples beyond |2|.
    """
    dev = torch.device(device)

    def normal(name: str, shape: tuple[int, ...] | torch.Size, std: float = 1.0,
               mean: float = 0.0) -> Tensor:
        gen = torch.Generator(device=dev).manual_seed(param_seed(seed, name))
        return torch.randn(tuple(shape), generator=gen, device=dev) * std + mean

    def init_conv(name: str, conv: nn.Conv1d | nn.ConvTranspose1d, weight_norm: bool,
                  scale: float) -> None:
        w = conv.weight  # Conv1d: [out, in/groups, k]; ConvTranspose1d: [in, out, k]
        if weight_norm:
            # unit-norm directions per dim-0 channel times g: keeps activations at unit scale
            v = normal(f"{name}.v", w.shape)
            g = normal(f"{name}.g", (w.shape[0],) + (1,) * (w.dim() - 1), 0.1, 1.0) * scale
            w.copy_(torch._weight_norm(v, g, 0))
        else:
            fan_in = w.shape[1] * w.shape[2] if isinstance(conv, nn.Conv1d) else w.shape[0]
            w.copy_(normal(f"{name}.weight", w.shape, 1.0 / math.sqrt(fan_in)))
        if conv.bias is not None:
            conv.bias.copy_(normal(f"{name}.bias", conv.bias.shape, 0.02))

    with torch.device("meta"):
        model = Codec(cfg)
    model = model.to_empty(device=dev).requires_grad_(False)  # float32 until the end
    for p in model.parameters():
        p.fill_(float("nan"))  # every parameter must be written below
    for mname, m in model.named_modules():
        scale = 0.75 if mname.startswith("decoder.") else 1.0
        if isinstance(m, Snake1d):
            m.alpha.copy_(normal(f"{mname}.alpha", m.alpha.shape, 0.2, 1.0).abs() + 0.1)
        elif isinstance(m, CausalConv1d | CausalConvTranspose1d):
            init_conv(mname, m.conv, m.weight_norm, scale)
        elif isinstance(m, VectorQuantizer):
            init_conv(f"{mname}.in_proj", m.in_proj, True, scale)
            init_conv(f"{mname}.out_proj", m.out_proj, True, scale)
            m.codebook.weight.copy_(normal(f"{mname}.codebook", m.codebook.weight.shape))
        elif isinstance(m, nn.Linear):
            m.weight.copy_(normal(f"{mname}.weight", m.weight.shape,
                                  1.0 / math.sqrt(m.weight.shape[1])))
            if m.bias is not None:
                m.bias.copy_(normal(f"{mname}.bias", m.bias.shape, 0.02))
        elif isinstance(m, LayerScale | ConvNeXtBlock):
            m.gamma.copy_(normal(f"{mname}.gamma", m.gamma.shape, 0.05, 0.3))
        elif isinstance(m, RMSNorm):
            m.weight.copy_(normal(f"{mname}.weight", m.weight.shape, 0.1, 1.0))
        elif isinstance(m, nn.LayerNorm):
            m.weight.copy_(normal(f"{mname}.weight", m.weight.shape, 0.1, 1.0))
            m.bias.copy_(normal(f"{mname}.bias", m.bias.shape, 0.02))
    # The fixture recipe leaves ~6% of pre-tanh samples beyond |2| at the tiny size; halving the
    # last conv's gain keeps dummy audio clearly inside tanh's linear range at every size.
    last = model.decoder.model[-2]
    assert isinstance(last, CausalConv1d)
    last.conv.weight.mul_(0.5)
    unset = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if unset:
        raise RuntimeError(f"dummy_codec left parameters uninitialised: {unset[:4]}")
    return model.to(dtype=dtype).eval()
