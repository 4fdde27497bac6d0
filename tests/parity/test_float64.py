"""``precision=64-true``: the same parity regime in float64, where a correct layout differs from one process by
summation order alone (~1e-14 relative) and a planted bug misses by many orders of magnitude more than in fp32.

Each case runs tests/support/parity.py's regime (lr 1e-2, clipping engaged, 8 steps, dumps at 0, 4 and 7) with
``precision=64-true`` against a one-process float64 run of the same settings; ``TOL64`` is about 50x the worst
error measured over these cases (gradients 3.7e-14, weights 2.2e-13, clip norm 1.4e-15, logged loss 0: the loss
is logged in float64). The fp32 suite keeps what fp32 itself tests (mixed precision, Float8, the fp32 noise of
each layout). The normaliser mutant whose fp32 margin was the smallest of the suite (4.6e3x) runs here too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity import CASES, EP_CASES, MASKED_DROP, MOE, Tolerance, check_case, measure, run_layout
from parity import run_user_case as _run_user

pytestmark = [pytest.mark.slow, pytest.mark.parity]

F64 = ["precision=64-true"]
TOL64 = Tolerance(grads=2e-12, norm=1e-13, params=1e-11, loss=1e-12)
DENSE = {
    "dp2_accum2": CASES["dp2_accum2"],
    "tp2": CASES["tp2"],
    "pp2xtp2": CASES["pp2xtp2"],
    "cp2_ring": CASES["cp2_ring"],
    "cp2_ulysses": CASES["cp2_ulysses"],
}
MOE_CASES = {
    "ep2xdp2": ["cluster.devices=4", "parallel.ep=2"],  # experts sharded over efsdp 2 x ep 2
    "ep2": EP_CASES["ep2"],  # the experts' FSDP dim one rank (dp_shard x cp = ep)
}


@pytest.fixture(scope="module")
def reference64(worlds, tmp_path_factory) -> Path:
    return run_layout(worlds, [*F64, "cluster.devices=1"], tmp_path_factory.mktemp("ref64"))


@pytest.fixture(scope="module")
def moe_reference64(worlds, tmp_path_factory) -> Path:
    return run_layout(worlds, [*F64, *MOE, "cluster.devices=1"], tmp_path_factory.mktemp("moe-ref64"))


@pytest.mark.parametrize("case", DENSE)
def test_dense_layouts_equal_one_process_in_float64(case, reference64, tmp_path, worlds):
    report = check_case(f"f64_{case}", reference64, run_layout(worlds, [*F64, *DENSE[case]], tmp_path), tol=TOL64)
    print(f"f64_{case}: {report.summary()}")


@pytest.mark.parametrize("case", MOE_CASES)
def test_expert_parallel_equals_one_process_in_float64(case, moe_reference64, tmp_path, worlds):
    got = run_layout(worlds, [*F64, *MOE, *MOE_CASES[case]], tmp_path)
    # the MoE reference learns 0.46 in its 8 steps (6.66 -> 6.20), with clipping engaged at every step
    report = check_case(f"f64_{case}", moe_reference64, got, tol=TOL64, min_loss_drop=0.4)
    print(f"f64_{case}: {report.summary()}")


def test_the_normaliser_mutant_misses_by_orders_of_magnitude_more_in_float64(worlds, tmp_path):
    """``normaliser_per_rank_mean`` at cp2 (MaskedLabels: the valid counts differ between the ranks): its margin in
    fp32 is 4.6e3x the fp32 tolerance (docs/testing.md); here against the float64 tolerance."""
    cp2 = ["cluster.devices=2", "parallel.cp=2"]
    reference = _run_user(worlds, "MaskedLabels", [*F64, "cluster.devices=1"], tmp_path / "single")
    check_case(
        "f64_masked_cp2",
        reference,
        _run_user(worlds, "MaskedLabels", [*F64, *cp2], tmp_path / "cp2"),
        tol=TOL64,
        min_loss_drop=MASKED_DROP,
    )
    bad = _run_user(worlds, "MaskedLabels", [*F64, *cp2], tmp_path / "mutant", "normaliser_per_rank_mean")
    margin, what = measure("f64_masked_cp2", reference, bad).margin(TOL64)
    print(f"normaliser_per_rank_mean on cp2 in float64: {margin:.3g}x the tolerance ({what})")
    assert margin >= 1e6, what
