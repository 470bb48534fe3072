"""csrc kernels: the contract of each wrapper, the fallback's semantics, and (on CUDA) that
the kernel and the fallback agree."""

from __future__ import annotations

import pytest
import torch

from engine import kernels


def _reference_shift(prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    return torch.cat([prev[:, 1:], nxt[:, None]], dim=1)


def test_prev_tokens_shift_fallback_semantics():
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, 4096, (5, 10, 10), dtype=torch.int32, generator=g)
    nxt = torch.randint(0, 4096, (5, 10), dtype=torch.int32, generator=g)
    want = _reference_shift(prev, nxt)
    kernels.prev_tokens_shift_inplace(prev, nxt)
    assert torch.equal(prev, want)


@pytest.mark.parametrize("prev,nxt,err", [
    (torch.zeros(2, 4, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32), TypeError),
    (torch.zeros(2, 4, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int64), TypeError),
    (torch.zeros(2, 12, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), ValueError),
    (torch.zeros(2, 4, 3, dtype=torch.int32), torch.zeros(3, 3, dtype=torch.int32), ValueError),
    (torch.zeros(2, 4, 3, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), ValueError),
    (torch.zeros(2, 3, 4, dtype=torch.int32).transpose(1, 2), torch.zeros(2, 3, dtype=torch.int32),
     ValueError),
])
def test_prev_tokens_shift_contract(prev, nxt, err):
    with pytest.raises(err):
        kernels.prev_tokens_shift_inplace(prev, nxt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prev_tokens_shift_cuda_kernel_matches_fallback():
    assert kernels.extension_available(), "the CUDA extension did not build"
    for bs, W, cw in ((1, 10, 10), (64, 16, 10), (129, 10, 1), (3, 1, 7)):
        prev = torch.randint(0, 4096, (bs, W, cw), dtype=torch.int32, device="cuda")
        nxt = torch.randint(0, 4096, (bs, cw), dtype=torch.int32, device="cuda")
        want = _reference_shift(prev, nxt)
        kernels.prev_tokens_shift_inplace(prev, nxt)
        assert torch.equal(prev, want)
