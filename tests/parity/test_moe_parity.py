"""The Qwen3-MoE family under TitanStrategy equals one process: gradients, clip norm, weights, expert bias, losses.

tests/support/moe_parity.py's regime (the sequence-wise auxiliary loss and the expert bias both on) on the
parity harness: per-parameter pre-clip gradients, the clipped norm, the weights and the expert bias after
steps 0, 4 and 7, each step's loss and auxiliary loss, against one shared one-process reference.
"""

import pytest

from helpers import read_metrics
from moe_parity import MOE_CASES, run_moe_case
from parity import check_case

pytestmark = pytest.mark.slow


def aux_losses(run_dir) -> list[float]:
    return [float(r["train/aux_loss"]) for r in read_metrics(run_dir) if r.get("train/aux_loss")]


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_layout_matches_single_process(case, moe_parity_reference, tmp_path, worlds):
    got = run_moe_case(worlds, case, tmp_path)
    check_case(case, moe_parity_reference, got)
    ref_aux, got_aux = aux_losses(moe_parity_reference), aux_losses(got)
    assert len(ref_aux) == len(got_aux) == 8 and len(set(ref_aux)) > 1, (ref_aux, got_aux)
    assert max(abs(g - r) / r for g, r in zip(got_aux, ref_aux)) < 1e-5, (ref_aux, got_aux)


TIE_TOL = 1e-9  # fp64: the measured error without a bug is ~1e-16


def test_routing_ties_break_alike_on_every_rank(worlds):
    """Every score tied (router weights zero): dp2 gradients equal one process, so ties go to the same
    experts on every rank (the lowest index), not in an order that depends on the device or rank."""
    assert worlds.run(2, "moe_tie_case:dp_ties_error").value < TIE_TOL
