"""Sharded (DCP) checkpoints through Lightning's ckpt_path: resume continues the same run,
also under another parallel layout (weights, optimizer, LR schedule and data position)."""

import pytest

from helpers import TINY, assert_losses_match, losses, read_metrics, run_cli

pytestmark = pytest.mark.slow

COMMON = [*TINY, "trainer.max_steps=8", "seed=0", "precision=32-true", "checkpoint.every_n_steps=4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    run_cli([*COMMON, "cluster.devices=2"], run_dir)  # dp2
    return run_dir


@pytest.mark.parametrize("layout", [["cluster.devices=2"], ["cluster.devices=2", "parallel.tp=2"]],
                         ids=["same-layout-dp2", "into-tp2"])
def test_resume_continues_with_same_losses(uninterrupted, tmp_path, layout):
    ckpt = uninterrupted / "checkpoints" / "step-000004.ckpt"
    assert (ckpt / ".metadata").is_file(), "DCP checkpoint missing"
    run_cli([*COMMON, *layout, f"resume={ckpt}"], tmp_path)
    resumed = read_metrics(tmp_path)
    assert [int(r["step"]) for r in resumed] == [4, 5, 6, 7]  # continues, does not restart
    assert_losses_match(losses(tmp_path), losses(uninterrupted)[4:], rtol=1e-5)


@pytest.mark.parametrize("make", ["missing", "incomplete"])
def test_bad_checkpoint_is_refused_before_training(tmp_path, make):
    ckpt = tmp_path / "step-000004.ckpt"
    if make == "incomplete":  # shards written, .metadata never published
        ckpt.mkdir()
        (ckpt / "__0_0.distcp").write_bytes(b"partial")
    proc = run_cli([*COMMON, f"resume={ckpt}"], tmp_path / "run", check=False)
    assert proc.returncode == 2
    assert "lit-titan: error: resume=" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
