"""A user's own loss is a layout too: subclasses that ignore labels, or smooth them, train equal to one process.

``user_modules.MaskedLabels`` ignores a per-sequence suffix of labels (1 to seq_len valid), so the valid counts
differ between ranks, micro-batches and context-parallel chunks: a per-rank or per-micro-batch mean, which
averaging would give, is not one device's loss. The step runner divides the sum over every valid target by
their global count (strategies/step.py). Each layout is compared with this file's one-process run of the same
subclass at the gradient harness's standard (tests/support/parity.py); the mutants of the normaliser are caught
by >= 10x its tolerance. ``SmoothedLoss`` (the README's label smoothing) trains under tensor parallel on gathered
logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity import MASKED_DROP, MOE, SEQUENCE_AUX, TOL, check_case, measure
from parity import run_user_case as _run

pytestmark = [pytest.mark.slow, pytest.mark.parity]

MIN_MARGIN = 10.0

LAYOUTS = {
    "dp2_accum2": ["cluster.devices=2", "data.micro_batch_size=2"],
    "cp2": ["cluster.devices=2", "parallel.cp=2"],
    "cp2_ring": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ulysses"],
    "pp2_accum2": ["cluster.devices=2", "parallel.pp=2", "data.micro_batch_size=4"],
}


@pytest.fixture(scope="module")
def smoothed_reference(worlds, tmp_path_factory) -> Path:
    return _run(worlds, "SmoothedLoss", ["cluster.devices=1"], tmp_path_factory.mktemp("smoothed-single"))


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_masked_labels_train_equal_to_one_process(case, masked_reference, tmp_path, worlds):
    got = _run(worlds, "MaskedLabels", LAYOUTS[case], tmp_path)
    check_case(f"masked_{case}", masked_reference, got, min_loss_drop=MASKED_DROP)


def test_per_target_losses_of_a_users_compute_loss_train_equal_to_one_process(masked_reference, tmp_path, worlds):
    """compute_loss returning one loss per target (reduction='none') is the same loss as the default's mean."""
    got = _run(worlds, "MaskedLabelsOwnLoss", ["cluster.devices=2"], tmp_path)
    check_case("masked_own_loss_dp2", masked_reference, got, min_loss_drop=MASKED_DROP)


def test_masked_labels_of_an_moe_model_train_equal_to_one_process_under_expert_parallel(worlds, tmp_path):
    """The MoE family's head makes the loss with its auxiliary loss inside: the cross-entropy is weighted per valid
    target, the auxiliary loss per micro-batch (ep2 with accumulation 2 against one process of the same subclass;
    the sequence-wise auxiliary loss, which accumulation leaves exact)."""
    moe = [*MOE, *SEQUENCE_AUX]
    reference = _run(worlds, "MaskedLabels", [*moe, "cluster.devices=1"], tmp_path / "single")
    got = _run(
        worlds,
        "MaskedLabels",
        [*moe, "cluster.devices=2", "parallel.ep=2", "data.micro_batch_size=2"],
        tmp_path / "ep2",
    )
    check_case("masked_moe_ep2_accum2", reference, got, min_loss_drop=MASKED_DROP)


@pytest.mark.parametrize(
    "mutant, case",
    [
        ("normaliser_per_rank_mean", "cp2"),
        ("normaliser_count_one_rank", "dp2_accum2"),
        ("normaliser_per_micro_batch_mean", "dp2_accum2"),
    ],
)
def test_normaliser_mutants_are_caught_with_a_10x_margin(mutant, case, masked_reference, tmp_path, worlds):
    report = measure(case, masked_reference, _run(worlds, "MaskedLabels", LAYOUTS[case], tmp_path, mutant))
    margin, what = report.margin(TOL)
    print(f"{mutant} on {case}: {margin:.3g}x the tolerance ({what})")
    assert margin >= MIN_MARGIN, (mutant, what)


@pytest.mark.parametrize(
    "layout",
    [["cluster.devices=2", "parallel.tp=2"], ["cluster.devices=4", "parallel.tp=2", "data.micro_batch_size=2"]],
    ids=["tp2", "dp2xtp2_accum2"],
)
def test_readme_smoothed_loss_trains_under_tensor_parallel_equal_to_one_process(
    layout, smoothed_reference, tmp_path, worlds
):
    check_case(
        f"smoothed_{'_'.join(o.split('=')[1] for o in layout)}",
        smoothed_reference,
        _run(worlds, "SmoothedLoss", layout, tmp_path),
    )
