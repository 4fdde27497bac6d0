"""The training job as a user runs it: console script, outputs, loggers."""

import os
import shutil
import sys

import yaml

from helpers import TINY, losses, read_metrics, run_cli, run_job


def test_cli_trains_and_loss_falls(tmp_path):
    exe = shutil.which("lit-titan") or os.path.join(os.path.dirname(sys.executable), "lit-titan")
    proc = run_job(
        [exe, "train", *TINY, "trainer.max_steps=30", "optim.lr=3e-3", "logger=tensorboard", f"run_dir={tmp_path}"],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == list(range(30))  # one row per optimizer step
    assert {"step", "train/loss", "train/lr", "train/grad_norm", "train/tokens_seen"} <= set(rows[0])
    loss = losses(tmp_path)
    # Means over 5 steps: single batches of a tiny model are noisy.
    assert sum(loss[-5:]) / 5 < 0.9 * sum(loss[:5]) / 5, loss
    # tokens_seen counts the global batch: 8 sequences x 32 tokens per step.
    assert float(rows[-1]["train/tokens_seen"]) == 30 * 8 * 32
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert cfg["trainer"]["max_steps"] == 30 and cfg["run_dir"] == str(tmp_path)
    assert "${" not in (tmp_path / "config.yaml").read_text()  # resolved
    assert any((tmp_path / "tensorboard").rglob("events.out.tfevents*"))
    assert (tmp_path / "checkpoints" / "step-000030" / ".metadata").is_file()  # the final checkpoint
    assert "tokens/s" in proc.stdout + proc.stderr


def test_wandb_logs_offline_without_an_account(tmp_path):
    run_cli([*TINY, "trainer.max_steps=2", "logger=wandb", "checkpoint.enabled=false"], tmp_path / "run")
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*")), "no offline W&B run was written"
    assert len(losses(tmp_path / "run")) == 2
