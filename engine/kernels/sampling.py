"""`sample_topk` (csrc/sampling.cu) and the sampling rule it implements, in torch.

The rule is the reference's: top-k / top-p mask computed on the un-tempered logits, then
temperature, softmax and an exponential race `argmax(p / E)`, E ~ Exponential(1). The noise
is counter-based (a hash of seed, step, stream and index), so a request's draws depend only
on its own seed and step, never on which other requests share the batch, and the whole
thing is plain tensor ops (CUDA-graph friendly). Temperature 0 means greedy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import kernel_ok

_M32 = 0xFFFFFFFF
TOPK_MAX = 128  # candidates kept per draw; top_k is capped here (the reference default is 30)
MAX_V = 8192  # the kernel's widest row


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (lowbias32) in int64 arithmetic; wraps are masked off."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def exponential_noise(seed: Tensor, step: Tensor, stream: int | Tensor, idx: Tensor | int) -> Tensor:
    """E ~ Exponential(1) for vocabulary indices `idx` ([B, n], or n for 0..n-1), a pure
    function of (seed[b], step[b], stream, index): a token's noise does not depend on which
    other tokens are candidates or which other requests share the batch. `stream` is one
    int for all rows or an int64 [B] tensor."""
    if isinstance(idx, int):
        idx = torch.arange(idx, device=seed.device, dtype=torch.int64)[None, :]
    key = _mix32(seed.to(torch.int64) * 0x9E3779B1 + stream * 0x632BE5AB)
    key = _mix32(key + step.to(torch.int64) * 0x85EBCA77)
    x = _mix32(key[:, None] + idx.to(torch.int64) * 0xC2B2AE3D)
    # uniform in (0, 1): the top hash value would round to exactly 1.0 in float32 (E = 0,
    # race = -inf), so it is clamped to the largest float below 1
    u = (((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp(max=1.0 - 2.0**-24)
    return -torch.log(u)


def sample(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
           step: Tensor, stream: int | Tensor) -> Tensor:
    """logits [B, V]; temperature/top_p [B] float; top_k [B] int (<= TOPK_MAX) -> ids [B].

    The reference's rule on the TOPK_MAX best candidates (everything past top_k is masked
    anyway): top-p on the un-tempered softmax of the whole row, then temperature, then the
    exponential race. Rows with temperature 0 take the argmax.
    """
    logits = logits.float()
    K = min(TOPK_MAX, logits.shape[-1])
    vals, idx = torch.topk(logits, K, dim=-1)  # [B, K], best first
    cum = torch.softmax(logits, dim=-1).gather(1, idx).cumsum(dim=-1)
    remove = cum > top_p[:, None]
    remove[:, 0] = False  # always keep the best
    rank = torch.arange(K, device=logits.device)
    remove |= rank[None, :] >= top_k[:, None]
    t = temperature.clamp(min=1e-5)[:, None]
    probs = torch.softmax(vals.masked_fill(remove, float("-inf")) / t, dim=-1)
    race = probs / exponential_noise(seed, step, stream, idx)
    drawn = idx.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, drawn, idx[:, 0])


def draw_then_embed(draw: Callable[..., Tensor], *args: object,
                    **kwargs: object) -> tuple[Tensor, Tensor]:
    """`draw(*args[:-1], **kwargs)` and the drawn ids' rows of the embedding table args[-1]
    [R, D] (the next position's input): -> (ids [B], table[ids] [B, D])."""
    *draw_args, table = args
    ids = draw(*draw_args, **kwargs)
    return ids, F.embedding(ids, table)  # type: ignore[arg-type]


def sample_embed(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                 seed: Tensor, step: Tensor, stream: int | Tensor,
                 table: Tensor) -> tuple[Tensor, Tensor]:
    """`sample`, and the drawn ids' rows of `table` (`draw_then_embed`)."""
    return draw_then_embed(sample, logits, temperature, top_p, top_k, seed, step, stream, table)


def check(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
          seed: Tensor, step: Tensor, stream: Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"logits must be float32 or bfloat16 [B, V], got {logits.dtype} "
                        f"{list(logits.shape)}")
    B = logits.shape[0]
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_p", top_p, torch.float32),
                        ("top_k", top_k, torch.int64), ("seed", seed, torch.int64),
                        ("step", step, torch.int64), ("stream", stream, torch.int64)):
        if t.dtype != dt or t.shape != (B,):
            raise TypeError(f"{name} must be {dt} [{B}], got {t.dtype} {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")


def _embeds_in_kernel(table: Tensor, logits: Tensor) -> bool:
    """Whether csrc's launch can copy rows of `table` (its contract, csrc/sampling.cu)."""
    return (table.dim() == 2 and table.is_contiguous() and table.device == logits.device
            and table.shape[0] >= logits.shape[1]
            and (table.shape[1] * table.element_size()) % 16 == 0 and table.data_ptr() % 16 == 0)


def _launch(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
            step: Tensor, stream: Tensor, pdl: bool, table: Tensor | None) -> tuple[Tensor, Tensor | None]:
    B = logits.shape[0]
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    rows = None if table is None else torch.empty(B, table.shape[1], dtype=table.dtype,
                                                  device=logits.device)
    torch.ops.rtvoice_kernels.sample_topk(logits, temperature.contiguous(), top_p.contiguous(),
                                          top_k.contiguous(), seed.contiguous(),
                                          step.contiguous(), stream.contiguous(), out, pdl,
                                          embed=table, embed_out=rows)
    return out, rows


def _kernel_takes(logits: Tensor, kernel: bool) -> bool:
    return logits.shape[1] <= MAX_V and logits.stride(1) == 1 and kernel_ok(kernel, logits)


def _streams(stream: int | Tensor, logits: Tensor) -> Tensor:
    if isinstance(stream, int):
        return torch.full((logits.shape[0],), stream, dtype=torch.int64, device=logits.device)
    return stream


def sample_topk(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
                step: Tensor, stream: int | Tensor, *, kernel: bool = True,
                pdl: bool = False) -> Tensor:
    """`sample` in one launch per batch: the same rule and noise, equal results but for float
    rounding at top-p boundaries and race near-ties. Runs `sample` off CUDA, for V > 8192,
    without the extension, or with `kernel=False`. `pdl` (sm_90+): the launch may start
    while the kernel before it finishes (csrc/launch.cuh; same result)."""
    stream = _streams(stream, logits)
    check(logits, temperature, top_p, top_k, seed, step, stream)
    if _kernel_takes(logits, kernel):
        return _launch(logits, temperature, top_p, top_k, seed, step, stream, pdl, None)[0]
    return sample(logits, temperature, top_p, top_k, seed, step, stream)


def sample_topk_embed(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                      seed: Tensor, step: Tensor, stream: int | Tensor, table: Tensor, *,
                      kernel: bool = True, pdl: bool = False) -> tuple[Tensor, Tensor]:
    """`sample_embed` in one launch: `sample_topk`'s draw, whose launch also copies the drawn
    rows of `table` [R, D] (R >= V; rows of a multiple of 16 bytes) — else the draw and then
    the lookup."""
    stream = _streams(stream, logits)
    check(logits, temperature, top_p, top_k, seed, step, stream)
    if table.dim() != 2 or table.device != logits.device or table.shape[0] < logits.shape[1]:
        raise ValueError(f"table must be [R, D] with R >= V = {logits.shape[1]} (a row for "
                         f"every drawable index) on {logits.device}, got {list(table.shape)} "
                         f"on {table.device}")
    if _kernel_takes(logits, kernel) and _embeds_in_kernel(table, logits):
        ids, rows = _launch(logits, temperature, top_p, top_k, seed, step, stream, pdl, table)
        assert rows is not None
        return ids, rows
    return draw_then_embed(sample_topk, logits, temperature, top_p, top_k, seed, step, stream,
                           table, kernel=kernel, pdl=pdl)
