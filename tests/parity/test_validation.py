"""Validation under every execution path: plain, pipeline (schedule eval), context and expert parallel.

Validation counts what training counts: ``trainer.val_check_interval`` optimizer steps (one Lightning batch is
a rank's whole step) and ``trainer.limit_val_batches`` global batches, so the same sequences are validated
under every layout and accumulation, their loss normalised over every valid target (strategies/step.py).

Each layout runs the parity regime of tests/support/parity.py (lr 1e-2, 8 steps, clipping engaged) with two
validation passes (after steps 4 and 8), so validation sees weights that moved; its losses, and the
pre-clip gradients, clip norm and weights at steps 0, 4 and 7, match one process of the same config
(this file's reference, shared by its cases: validation changes the run's config, not its training).
"""

import pytest

from helpers import read_metrics
from parity import MOE, PARITY, TOL, check_case, measure, run_dump

pytestmark = pytest.mark.slow

VAL = ["trainer.limit_val_batches=2", "trainer.val_check_interval=4", "checkpoint.enabled=false"]
# Validation losses, relative: seen 7.9e-8 at most (2026-11-25, the three layouts); the bound as before.
VAL_RTOL = 1e-5


def _val_losses(run_dir):
    return [float(r["val/loss"]) for r in read_metrics(run_dir) if r.get("val/loss")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worlds):
    return run_dump(worlds, [*PARITY, *VAL, "cluster.devices=1"], tmp_path_factory.mktemp("val-single"))


@pytest.mark.parametrize(
    "layout",
    [
        ["cluster.devices=2", "parallel.pp=2"],
        ["cluster.devices=2", "parallel.cp=2"],
        ["cluster.devices=4", "parallel.pp=2", "parallel.tp=2"],
        ["cluster.devices=2", "data.micro_batch_size=2"],
    ],
    ids=["pp2", "cp2", "pp2xtp2", "dp2_accum2"],
)
@pytest.mark.parity
def test_validation_loss_matches_single_process(layout, reference, tmp_path, worlds):
    want = _val_losses(reference)
    assert len(want) == 2 and want[0] > want[1] > 0, want  # validation saw the weights learn
    run_dump(worlds, [*PARITY, *VAL, *layout], tmp_path)  # reused gloo worlds (tests/support/world.py)
    got = _val_losses(tmp_path)
    assert len(got) == 2
    worst = max(abs(g - r) / r for g, r in zip(got, want))
    print(f"validation loss: worst relative error {worst:.3g}")
    assert worst < VAL_RTOL, (got, want)
    check_case(f"val_{'_'.join(o.split('=')[1] for o in layout)}", reference, tmp_path)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, worlds):
    return run_dump(worlds, [*PARITY, *MOE, *VAL, "cluster.devices=1"], tmp_path_factory.mktemp("val-moe-single"))


@pytest.mark.parity
def test_moe_validation_under_expert_parallel_matches_and_moves_no_training_state(moe_reference, tmp_path, worlds):
    """The expert bias moves only by training's counts: a validation pass between steps changes nothing the
    next steps compute (the weights and bias after each dumped step equal one process's, which validates too);
    the mutant whose evaluation counts tokens into the bias is caught by >= 10x."""
    want = _val_losses(moe_reference)
    run_dump(worlds, [*PARITY, *MOE, *VAL, "cluster.devices=2", "parallel.ep=2"], tmp_path / "ep2")
    got = _val_losses(tmp_path / "ep2")
    assert len(got) == len(want) == 2 and max(abs(g - r) / r for g, r in zip(got, want)) < VAL_RTOL, (got, want)
    check_case("val_moe_ep2", moe_reference, tmp_path / "ep2")

    mutant = run_dump(worlds, [*PARITY, *MOE, *VAL, "cluster.devices=1"], tmp_path / "mutant", "eval_moves_expert_bias")
    margin, what = measure("val_moe_mutant", moe_reference, mutant).margin(TOL)
    print(f"eval_moves_expert_bias: {margin:.3g}x the tolerance ({what})")
    assert margin >= 10, what
