"""The decode step's bookkeeping (engine/bookkeeping.py): the values each function must give,
and its compiled version giving the same ones (inductor's CPU backend, and CUDA)."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.bookkeeping import (
    Bookkeeping,
    frame_tokens,
    ras_choose,
    ras_inputs,
    step_begin,
    step_end,
)

IM_END = 9


def _rows() -> list[torch.Tensor]:
    """was, next_col, pos, frames_left, active for three rows: running, idle, on its last
    frame."""
    return [torch.tensor([True, False, True]),
            torch.arange(6).reshape(3, 2),
            torch.tensor([5, 0, 7]), torch.tensor([4, 0, 1]), torch.tensor([True, False, True])]


def test_step_begin_sends_inactive_rows_to_the_scratch_block():
    active = torch.tensor([True, False, True])
    pos = torch.tensor([3, 70, 130])
    tables = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    was, p, block = step_begin(active, pos, tables, 64, 99)
    assert was.tolist() == [True, False, True] and was.data_ptr() != active.data_ptr()
    assert p.tolist() == [3, 0, 130]
    assert block.tolist() == [10, 99, 32]


def _columns(frames: list[list[int]]) -> list[torch.Tensor]:
    return list(torch.tensor(frames).unbind(1))


def test_step_end_updates_the_rows_in_place_and_stops_them():
    was, next_col, pos, left, active = _rows()
    draw_step = torch.tensor([0, 7, 3])
    # row 0 ends, row 2 runs out
    out = step_end(_columns([[IM_END, 1], [4, 4], [3, 3]]), was, next_col, pos, left, active,
                   draw_step, IM_END)
    assert next_col.tolist() == [[IM_END, 1], [2, 3], [3, 3]]  # the idle row keeps its column
    assert pos.tolist() == [6, 0, 8] and left.tolist() == [3, 0, 0]
    assert active.tolist() == [False, False, False]
    assert draw_step.tolist() == [1, 8, 4]  # every row's draws advance, as Sampling.advance
    assert out.tolist() == [[IM_END, 1, 1, 1], [4, 4, 0, 0], [3, 3, 1, 1]]
    was, next_col, pos, left, active = _rows()
    out = step_end(_columns([[1, 1], [4, 4], [3, 3]]), was, next_col, pos,
                   left.add_(5), active, draw_step, IM_END)
    assert active.tolist() == [True, False, True] and out[:, -1].tolist() == [0, 0, 0]


def test_frame_tokens_maps_the_draw_to_ids():
    table = torch.arange(8 * 3).reshape(8, 3).float()
    h = -torch.rand(3, 3)
    token, code, x = frame_tokens(torch.tensor([0, 5, 8]), 8, 100, IM_END, table, h)
    assert token.tolist() == [100, 105, IM_END] and code.tolist() == [0, 5, 0]
    # the fast AR's positions 0 (h) and 1 (code 0's rows; <|im_end|>'s is row 0)
    assert x.shape == (3, 2, 3)
    assert torch.equal(x[:, 0], h) and torch.equal(x[:, 1], table[[0, 5, 0]])


def test_ras_takes_the_second_draw_only_for_a_repeat_in_the_window():
    # rows: main 3 is in the counted window; main 4 only in the uncounted part; main 8 is
    # <|im_end|> (index n_semantic); a repeat at step 0
    both = torch.tensor([3, 4, 8, 3, 30, 40, 80, 30])
    window = torch.tensor([[-1, 1, 3], [4, 2, 1], [8, 8, 8], [3, 3, 3]], dtype=torch.int32)
    ras_window = torch.tensor([2, 2, 3, 3])
    step = torch.tensor([5, 5, 5, 0])
    chosen, cond, nxt = ras_choose(both, window, ras_window, step, 8)
    assert cond.tolist() == [True, False, False, True]
    assert chosen.tolist() == [30, 4, 8, 30]
    assert nxt.dtype == torch.int32 and nxt.tolist() == [[30], [4], [8], [-1]]


def test_ras_inputs_stack_main_and_ras_settings():
    logits = torch.randn(2, 5)
    out = ras_inputs(logits, torch.tensor([0.0, 0.7]), torch.tensor([1.0, 1.0]),
                     torch.tensor([0.8, 0.8]), torch.tensor([0.9, 0.9]),
                     torch.tensor([30, 20]), torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert torch.equal(out[0], torch.cat([logits, logits]))
    assert out[1].tolist() == pytest.approx([0.0, 0.7, 0.0, 1.0])  # greedy stays greedy
    assert out[2].tolist() == pytest.approx([0.8, 0.8, 0.9, 0.9])
    assert [t.tolist() for t in out[3:]] == [[30, 20, 30, 20], [1, 2, 1, 2], [3, 4, 3, 4]]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None,
        reason="torch.compile on the CPU needs a C++ compiler")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_compiled_bookkeeping_matches_the_reference(device: str):
    """build_ops' functions (compiled, and on CUDA csrc's one-launch kernels for ras_inputs,
    frame_tokens and step_end) give the reference's values at several batch sizes, in-place
    updates included."""
    from engine.ops import build_ops

    book, ref = build_ops(device, fused="compile").book, Bookkeeping()
    assert book.step_end is not ref.step_end
    g = torch.Generator().manual_seed(0)
    def rows(B: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(B)
        return [torch.rand(B, generator=gen) < 0.7,
                torch.randint(0, 20, (B, 11), generator=gen),
                torch.randint(0, 500, (B,), generator=gen),
                torch.randint(0, 3, (B,), generator=gen),
                torch.rand(B, generator=gen) < 0.7]

    for B in (1, 2, 5, 64):
        frames = torch.randint(0, 12, (B, 11), generator=g).to(device)
        tables = torch.randint(0, 100, (B, 8), generator=g).to(device)
        a = [t.to(device) for t in rows(B)]
        c = [t.to(device) for t in rows(B)]
        steps = [torch.randint(0, 9, (B,), generator=g).to(device) for _ in range(2)]
        steps[1].copy_(steps[0])
        cols = [c.contiguous() for c in frames.unbind(1)]  # as the draws give them
        with torch.inference_mode():
            for x, y in zip(ref.step_begin(a[4], a[2], tables, 64, 7),
                            book.step_begin(c[4], c[2], tables, 64, 7)):
                assert torch.equal(x, y)
            assert torch.equal(ref.step_end(cols, *a[:4], a[4], steps[0], IM_END),
                               book.step_end(cols, *c[:4], c[4], steps[1], IM_END))
            assert all(torch.equal(x, y) for x, y in zip(a, c))
            assert torch.equal(steps[0], steps[1])
            idx = torch.randint(0, 9, (B,), generator=g).to(device)
            table = torch.randn(8, 64, generator=g).to(torch.bfloat16).to(device)
            h = torch.randn(B, 64, generator=g).to(torch.bfloat16).to(device)
            for x, y in zip(ref.frame_tokens(idx, 8, 100, IM_END, table, h),
                            book.frame_tokens(idx, 8, 100, IM_END, table, h)):
                assert torch.equal(x, y)
            both = torch.randint(0, 10, (2 * B,), generator=g).to(device)
            win = torch.randint(-1, 10, (B, 16), generator=g).to(torch.int32).to(device)
            rw = torch.randint(0, 17, (B,), generator=g).to(device)
            step = torch.randint(0, 3, (B,), generator=g).to(device)
            for x, y in zip(ref.ras_choose(both, win, rw, step, 8),
                            book.ras_choose(both, win, rw, step, 8)):
                assert torch.equal(x, y)
            args = (torch.randn(B, 33, generator=g).to(device), torch.rand(B, generator=g).to(device),
                    torch.rand(B, generator=g).to(device), torch.rand(B, generator=g).to(device),
                    torch.rand(B, generator=g).to(device), torch.randint(1, 30, (B,)).to(device),
                    torch.randint(0, 9, (B,)).to(device), torch.randint(0, 9, (B,)).to(device))
            for x, y in zip(ref.ras_inputs(*args), book.ras_inputs(*args)):
                assert torch.equal(x, y)
