"""The FP8-vs-bf16 correctness gate (engine/fp8_gate.py): it passes on a correct FP8 path
and fails, by a wide factor, on the two scale-layout bugs (transposed, one block off)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import fp8_gate
from engine.fp8_gate import BOUND, CONTROLS, PLANT_MIN_SIGMA, corrupt_scales, main, run_gate
from engine.quant import Fp8Linear


@pytest.fixture(scope="module")
def small_report():
    torch.manual_seed(0)  # nothing in the gate draws from the global generator; belt and braces
    return run_gate("gate-small", device="cpu", frames=5, seed=0, controls=True)


def test_gate_passes_on_planted_small_model(small_report):
    r = small_report
    assert r["decisions"] == 5 * 10  # per frame: 1 semantic + 9 codebook decisions
    assert len(r["frames_bf16"]) == 5 and all(len(f) == 11 for f in r["frames_bf16"])
    assert r["planted"] and r["min_margin_sigma"] >= PLANT_MIN_SIGMA
    assert r["tokens_equal"] and r["first_mismatch"] is None
    assert r["frames_fp8"] == r["frames_bf16"]
    assert r["compared"] == r["decisions"]
    for head in ("slow", "fast"):
        err = r["rel_err"][head]["max"]
        # FP8 really ran (a bf16-vs-bf16 comparison would give 0) and stays within the bound
        assert 0.01 < err <= BOUND / 2, (head, err)
    assert r["fp8_min_margin_sigma"] > PLANT_MIN_SIGMA / 2  # flips are far away
    assert r["gate_passed"] and r["passed"]


def test_controls_fail_by_a_wide_factor(small_report):
    ctl = small_report["controls"]
    assert set(ctl) == set(CONTROLS) and small_report["controls_fail"]
    for kind, c in ctl.items():
        assert c["applicable"] and c["changed_layers"] == 30, kind  # every FP8 linear
        assert not c["passed"], kind
        worst = max(v["max"] for v in c["rel_err"].values() if v["max"] is not None)
        assert worst > 2.5 * BOUND, (kind, worst)


def test_corrupt_scales_layouts():
    q = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    s = torch.arange(6, dtype=torch.float32).view(2, 3)
    lin = torch.nn.Sequential(Fp8Linear(q, s.clone()), Fp8Linear(q[:128, :128], s[:1, :1].clone()))
    assert corrupt_scales(lin, "transposed") == 1  # a 1x1 grid cannot change
    assert lin[0].weight_scale_inv.tolist() == [[0, 3, 1], [4, 2, 5]]  # s.t() read as [2, 3]
    lin[0].weight_scale_inv = s.clone()
    assert corrupt_scales(lin, "shifted") == 1
    assert lin[0].weight_scale_inv.tolist() == [[2, 0, 1], [5, 3, 4]]  # one block along K
    lin[0].weight.check()
    with pytest.raises(ValueError, match="unknown control"):
        corrupt_scales(lin, "mirrored")


def test_cli_json_report_and_exit_codes(tmp_path, capsys):
    out = tmp_path / "gate.json"
    assert main(["--model", "tiny", "--frames", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("model", "device", "frames", "seed", "planted", "plant", "decisions",
                "min_margin", "min_margin_sigma", "tokens_equal", "first_mismatch",
                "frames_bf16", "frames_fp8", "compared", "rel_err", "fp8_min_margin_sigma",
                "bound", "gate_passed", "passed", "per_decision"):
        assert key in r, key
    assert r["model"] == "tiny" and r["decisions"] == 20 and r["bound"] == BOUND
    assert set(r["rel_err"]) == {"slow", "fast"} and set(r["rel_err"]["slow"]) == {"max", "mean"}
    assert "gate: PASS" in capsys.readouterr().out
    # the same run against an impossible bound: the gate must be able to fail
    assert main(["--model", "tiny", "--frames", "2", "--bound", "1e-6"]) == 1
    assert "gate: FAIL" in capsys.readouterr().out


def test_planted_model_is_deterministic():
    a = fp8_gate.build_setup("tiny", seed=3, frames=2)
    b = fp8_gate.build_setup("tiny", seed=3, frames=2)
    assert a.plant is not None and a.plant.planted > 0
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), n
    assert torch.equal(a.prompt, b.prompt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gate_s2_pro_on_cuda():
    """S2-Pro at real size, bf16 vs FP8 on the GPU with the ops an engine builds
    (`build_ops("cuda")`: fused ops, csrc kernels, whatever `Ops.linear` routes FP8 to)."""
    r = run_gate("s2-pro", device="cuda", frames=5, seed=0, controls=True)
    print(fp8_gate.format_report(r))
    assert r["decisions"] == 50 and r["tokens_equal"], r["first_mismatch"]
    assert r["gate_passed"], r["rel_err"]
    for kind, c in r["controls"].items():
        assert c["applicable"] and not c["passed"], kind
        worst = max(v["max"] for v in c["rel_err"].values() if v["max"] is not None)
        assert worst > 2 * BOUND, (kind, worst)


def test_gate_passes_with_the_rowwise_w8a8_linears():
    """`--w8a8 rowwise`: every FP8 linear through the rowwise-scaled W8A8 GEMM (weights
    requantised per row, activations per row: `fp8_activations`' rowwise path, at every M,
    here torch's CPU _scaled_mm): the gate passes on the planted small model with a larger
    error than the weight-only one, and the corrupted-scale controls (their rowwise copies
    made from the corrupted scales) still fail; `table` needs CUDA."""
    r = run_gate("gate-small", device="cpu", controls=True, w8a8="rowwise")
    assert r["tokens_equal"] and r["passed"] and r["w8a8"] == "rowwise", r
    assert 0.06 < r["rel_err"]["slow"]["max"] < BOUND  # the weight-only gate's: 0.057
    assert all(not c["passed"] for c in r["controls"].values())
    with pytest.raises(ValueError, match="CUDA"):
        run_gate("gate-small", device="cpu", w8a8="table")
    with pytest.raises(ValueError, match="w8a8 must be one of"):
        run_gate("gate-small", device="cpu", w8a8="bogus")
    assert main(["--w8a8", "rowwise", "--frames", "2"]) == 0
