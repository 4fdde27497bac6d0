"""Checkpoints and recovery (issue 7): sharded DCP saves, written asynchronously and published
atomically; bitwise-exact resume; resume into other layouts with the data position kept; automatic
restart after a rank dies (also mid-save); damaged checkpoints refused, the previous one used."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from helpers import TINY, assert_losses_match, losses, read_metrics, run_cli, run_job

from lit_titan.checkpoint import CheckpointError, latest_valid, prune, published, validate

pytestmark = pytest.mark.slow

STEPS, EVERY = 20, 10
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "seed=0", "precision=32-true", "trainer.deterministic=true",
          "checkpoint.keep_last=0"]
DP2_TP2 = ["cluster.devices=4", "parallel.tp=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worlds) -> Path:
    """20 uninterrupted steps under dp2 x tp2, a checkpoint every 10."""
    run_dir = tmp_path_factory.mktemp("reference")
    worlds.train([*COMMON, *DP2_TP2, f"checkpoint.every_n_steps={EVERY}"], run_dir)
    return run_dir


def test_async_saves_are_published_complete(reference):
    ckpts = reference / "checkpoints"
    assert [p.name for p in published(ckpts)] == ["step-000010", "step-000020"]
    assert not list(ckpts.glob("*.partial")), "a finished run left an unpublished save"
    for ckpt in published(ckpts):
        validate(ckpt)
        assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [f"rank-{r:05d}.pt" for r in range(4)]


def test_resume_is_bitwise_exact(reference, tmp_path, worlds):
    worlds.train([*COMMON, *DP2_TP2, f"resume={reference / 'checkpoints' / 'step-000010'}"], tmp_path)
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == list(range(EVERY, STEPS))  # continues
    assert losses(tmp_path) == losses(reference)[EVERY:]  # bitwise, not approximately


@pytest.mark.parametrize("layout", [["cluster.devices=4", "parallel.pp=2"], ["cluster.devices=4", "data.num_workers=2"],
                                    ["cluster.devices=1"], ["cluster.devices=1", "data.micro_batch_size=2"]],
                         ids=["pp2xdp2", "dp4-2workers", "one-process", "one-process-accum4"])
def test_resume_into_another_layout(reference, tmp_path, layout, worlds):
    """Weights, optimizer, LR schedule and the data position carry over: the data-parallel size
    changes (2 -> 2, 4, 1), and every later step sees the same samples as the uninterrupted run."""
    worlds.train([*COMMON, *layout, f"resume={reference / 'checkpoints' / 'step-000010'}"], tmp_path)
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == list(range(EVERY, STEPS))
    assert_losses_match(losses(tmp_path), losses(reference)[EVERY:], rtol=1e-5)


def test_resume_auto_skips_a_damaged_checkpoint(reference, tmp_path, worlds):
    ckpts = tmp_path / "checkpoints"
    for step in ("step-000010", "step-000020"):
        shutil.copytree(reference / "checkpoints" / step, ckpts / step)
    _truncate_a_shard(ckpts / "step-000020")
    proc = worlds.train([*COMMON, "cluster.devices=2", "resume=auto"], tmp_path)
    assert "skipping damaged checkpoint" in proc.stderr and "resuming from" in proc.stderr
    assert f"{ckpts / 'step-000010'}" in proc.stderr
    assert_losses_match(losses(tmp_path), losses(reference)[EVERY:], rtol=1e-5)
    assert (ckpts / "step-000020.damaged").is_dir()  # kept for inspection, never deleted
    validate(ckpts / "step-000020")  # the step was saved again, complete


@pytest.mark.parametrize("fault", [["fault.at_step=13"], ["fault.at_step=10", "fault.during_save=true"]],
                         ids=["killed-at-step", "killed-during-save"])
def test_torchrun_restarts_a_killed_rank_and_resumes(reference, tmp_path, fault):
    """The documented fault-tolerant launch: torchrun --max-restarts with resume=auto."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m", "lit_titan.train",
           *COMMON, "cluster.devices=2", "checkpoint.every_n_steps=5", "resume=auto", "fault.kill_rank=1", *fault,
           f"run_dir={tmp_path}"]
    proc = run_job(cmd, timeout=400)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "fault injection: killing rank 1" in proc.stderr, proc.stderr[-5000:]
    # Under torchrun the agent names the dead rank and its signal in one line (and stops the survivor at
    # once with SIGTERM); nothing blames the disk, no traceback. Lightning's launcher: the survivor's line,
    # test_gpu_path_checkpoint.py::test_a_rank_killed_during_a_save_is_named_with_its_signal_in_one_line.
    assert "failed (exitcode: -9) local_rank: 1" in proc.stderr, proc.stderr[-5000:]
    assert "free space" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-5000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("lit-titan: error:")], proc.stderr[-5000:]
    # Killed after step 13 (checkpoint 10 published) or while saving step 10 (never published: 5 is newest).
    resumed_from = 10 if "fault.at_step=13" in fault else 5
    assert f"resuming from {tmp_path / 'checkpoints' / f'step-{resumed_from:06d}'}" in proc.stderr, proc.stderr[-5000:]
    first = read_metrics(tmp_path)
    assert int(first[0]["step"]) == resumed_from and int(first[-1]["step"]) == STEPS - 1
    assert_losses_match(losses(tmp_path), losses(reference)[resumed_from:], rtol=1e-5)
    assert list(tmp_path.glob("metrics.attempt-0.csv"))  # the killed attempt's metrics are kept
    for ckpt in published(tmp_path / "checkpoints"):
        validate(ckpt)


# ---- damaged checkpoints (no processes) ---------------------------------------------------------
def _copy(reference: Path, tmp_path: Path) -> Path:
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", ckpts)
    return ckpts


def _truncate_a_shard(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


def test_damaged_checkpoints_are_refused_and_the_previous_one_used(reference, tmp_path):
    ckpts = _copy(reference, tmp_path)
    newest = ckpts / "step-000020"
    _truncate_a_shard(newest)
    with pytest.raises(CheckpointError, match="truncated"):
        validate(newest)
    ckpt, skipped = latest_valid(ckpts)
    assert ckpt == ckpts / "step-000010" and skipped[0][0] == newest
    (newest / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match="corrupt"):
        validate(newest)
    # A tampered .metadata that would run a command when unpickled is refused without running it.
    _Exploit.marker = tmp_path / "pwned"
    (newest / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError, match="not allowed"):
        validate(newest)
    assert not _Exploit.marker.exists()
    (ckpts / "step-000010" / "meta.pt").unlink()
    with pytest.raises(CheckpointError, match="meta.pt"):
        validate(ckpts / "step-000010")


def test_prune_keeps_the_newest_k_and_only_old_partials(tmp_path):
    for name in ("step-000001", "step-000002", "step-000003", "step-000001.partial", "step-000004.partial"):
        (tmp_path / name).mkdir()
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003", "step-000004.partial"]


@pytest.mark.parametrize("make", ["incomplete", "truncated"])
def test_damaged_resume_path_is_refused_with_the_reason(reference, tmp_path, make):
    from lit_titan.train import resolve_resume

    ckpt = tmp_path / "step-000004"
    if make == "incomplete":  # shards written, .metadata never published
        ckpt.mkdir()
        (ckpt / "__0_0.distcp").write_bytes(b"partial")
    else:
        ckpt = _copy(reference, tmp_path) / "step-000020"
        _truncate_a_shard(ckpt)
    with pytest.raises(CheckpointError, match="resume=.* cannot be used: .*(no .metadata|truncated)"):
        resolve_resume(str(ckpt), tmp_path / "run")


@pytest.mark.parametrize("make", ["missing", "newer-exist"])
def test_bad_resume_is_refused_before_training(reference, tmp_path, make):
    """Through the command line: one error line, exit 2, nothing started."""
    ckpt = tmp_path / "step-000004"
    run_dir = tmp_path / "run"
    if make == "newer-exist":  # resuming an old step into a run that has newer ones would overwrite them
        ckpt = _copy(reference, run_dir) / "step-000010"
    proc = run_cli([*COMMON, f"resume={ckpt}"], run_dir, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "lit-titan: error: resume=" in proc.stderr or "lit-titan: error: run_dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.csv").exists()  # nothing started
