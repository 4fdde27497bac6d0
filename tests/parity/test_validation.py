"""Validation under every execution path: plain, pipeline (schedule eval) and context parallel."""

import pytest

from helpers import TINY, read_metrics

pytestmark = pytest.mark.slow

COMMON = [*TINY, "trainer.max_steps=4", "seed=0", "precision=32-true", "checkpoint.enabled=false",
          "trainer.limit_val_batches=2", "trainer.val_check_interval=4"]


def _val_losses(run_dir):
    return [float(r["val/loss"]) for r in read_metrics(run_dir) if r.get("val/loss")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worlds):
    run_dir = tmp_path_factory.mktemp("single")
    worlds.train([*COMMON, "cluster.devices=1"], run_dir)
    return _val_losses(run_dir)


@pytest.mark.parametrize("layout", [
    ["cluster.devices=2", "parallel.pp=2"],
    ["cluster.devices=2", "parallel.cp=2"],
    ["cluster.devices=4", "parallel.pp=2", "parallel.tp=2"],
], ids=["pp2", "cp2", "pp2xtp2"])
@pytest.mark.parity
def test_validation_loss_matches_single_process(layout, reference, tmp_path, worlds):
    assert len(reference) == 1 and reference[0] > 0
    worlds.train([*COMMON, *layout], tmp_path)  # reused gloo worlds (tests/support/world.py), not fresh interpreters
    got = _val_losses(tmp_path)
    assert len(got) == 1
    assert abs(got[0] - reference[0]) / reference[0] < 1e-5, (got, reference)
