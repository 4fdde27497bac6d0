"""Checkpoints and recovery: sharded DCP saves, written asynchronously and published
atomically; bitwise-exact resume; resume into other layouts with the data position kept; automatic
restart after a rank dies (also mid-save); damaged checkpoints refused, the previous one used."""

from __future__ import annotations

import json
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
COMMON = [
    *TINY,
    f"trainer.max_steps={STEPS}",
    "seed=0",
    "precision=32-true",
    "trainer.deterministic=true",
    "checkpoint.keep_last=0",
]
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


@pytest.mark.parametrize(
    "layout",
    [
        ["cluster.devices=4", "parallel.pp=2"],
        ["cluster.devices=4", "data.num_workers=2"],
        ["cluster.devices=1"],
        ["cluster.devices=1", "data.micro_batch_size=2"],
    ],
    ids=["pp2xdp2", "dp4-2workers", "one-process", "one-process-accum4"],
)
def test_resume_into_another_layout(reference, tmp_path, layout, worlds):
    """Weights, optimizer, LR schedule and the data position carry over: the data-parallel size
    changes (2 -> 2, 4, 1), and every later step sees the same samples as the uninterrupted run."""
    worlds.train([*COMMON, *layout, f"resume={reference / 'checkpoints' / 'step-000010'}"], tmp_path)
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == list(range(EVERY, STEPS))
    assert_losses_match(losses(tmp_path), losses(reference)[EVERY:], rtol=1e-5)


def test_resume_auto_skips_damaged_and_tampered_checkpoints(reference, tmp_path, worlds):
    """Newest first: a pickle payload in a non-tensor entry (checksums rewritten to match, as an
    attacker would), then flipped bytes in a shard; both set aside, never run; the run resumes from
    the one before and its losses continue the uninterrupted run's."""
    ckpts = tmp_path / "checkpoints"
    for step in ("step-000010", "step-000020"):
        shutil.copytree(reference / "checkpoints" / step, ckpts / step)
    shutil.copytree(ckpts / "step-000020", ckpts / "step-000015")
    marker = tmp_path / "payload-ran"
    _tamper_an_entry(ckpts / "step-000020", marker)
    _flip_a_byte(ckpts / "step-000015")
    proc = worlds.train([*COMMON, "cluster.devices=2", "resume=auto"], tmp_path)
    assert "skipping damaged checkpoint" in proc.stderr and "resuming from" in proc.stderr
    assert "entry optimizer_0.param_groups.0.params holds more than tensors and plain data" in proc.stderr
    assert "__0_0.distcp does not match its checksum" in proc.stderr
    assert f"{ckpts / 'step-000010'}" in proc.stderr
    assert_losses_match(losses(tmp_path), losses(reference)[EVERY:], rtol=1e-5)
    for step in ("step-000015", "step-000020"):
        assert (ckpts / f"{step}.damaged").is_dir()  # kept for inspection, never deleted
    validate(ckpts / "step-000020", verify=True)  # the step was saved again, complete, with checksums
    assert not marker.exists()


@pytest.mark.parametrize(
    "fault",
    [["fault.at_step=13"], ["fault.at_step=10", "fault.during_save=true"]],
    ids=["killed-at-step", "killed-during-save"],
)
def test_torchrun_restarts_a_killed_rank_and_resumes(reference, tmp_path, fault):
    """The documented fault-tolerant launch: torchrun --max-restarts with resume=auto."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        "-m",
        "lit_titan.train",
        *COMMON,
        "cluster.devices=2",
        "checkpoint.every_n_steps=5",
        "resume=auto",
        "fault.kill_rank=1",
        *fault,
        f"run_dir={tmp_path}",
    ]
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


def _flip_a_byte(ckpt: Path) -> None:
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


class _Exploit:
    def __init__(self, marker: Path | None = None) -> None:
        self.marker = marker or _Exploit.marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tamper_an_entry(ckpt: Path, marker: Path) -> str:
    """Replace the largest non-tensor entry (the param-group's parameter names) by a torch.save'd
    pickle that runs ``touch marker`` when loaded with weights_only=False (DCP's default), padded to
    the entry's length so .metadata stays valid; checksums.json updated to match."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from lit_titan.checkpoint.layout import CHECKSUMS, file_crc32, read_dcp_metadata

    metadata = read_dcp_metadata(ckpt)
    index, info = max(
        (
            (i, s)
            for i, s in metadata.storage_data.items()
            if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
        ),
        key=lambda item: item[1].length,
    )
    buf = io.BytesIO()
    torch.save(_Exploit(marker), buf, _use_new_zipfile_serialization=False)  # the legacy format reads past padding
    payload = buf.getvalue()
    assert len(payload) <= info.length, (len(payload), info.length)
    shard = ckpt / str(info.relative_path)
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + info.length] = payload.ljust(info.length, b"\0")
    shard.write_bytes(bytes(data))
    record = json.loads((ckpt / CHECKSUMS).read_text())
    record["files"][str(info.relative_path)] = file_crc32(shard)
    (ckpt / CHECKSUMS).write_text(json.dumps(record))
    return index.fqn


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


def test_no_entry_is_unpickled_and_every_file_is_checksummed(reference, tmp_path):
    """The load itself (not only validate) reads non-tensor entries as plain data; flipped bytes are
    named by file; a checkpoint without checksums (an earlier version's) still validates."""
    import torch.distributed.checkpoint as dcp

    from lit_titan.checkpoint.layout import CHECKSUMS
    from lit_titan.checkpoint.writer import _load
    from lit_titan.job.resume import resolve_resume

    ckpts = _copy(reference, tmp_path)
    ckpt = ckpts / "step-000020"
    files = json.loads((ckpt / CHECKSUMS).read_text())["files"]
    assert sorted(files) == sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != CHECKSUMS
    )  # every file, every rank's
    marker = tmp_path / "payload-ran"
    entry = _tamper_an_entry(ckpt, marker)
    state = {"optimizer_0": {"param_groups": [{"params": []}]}}  # just that entry
    with pytest.raises(CheckpointError, match=f"entry {entry} holds more than tensors and plain data.*GLOBAL posix"):
        _load(dcp, state, ckpt)
    assert not marker.exists()
    _flip_a_byte(ckpts / "step-000010")
    validate(ckpts / "step-000010")  # the cheap checks cannot see it
    with pytest.raises(
        CheckpointError,
        match=r"resume=.* cannot be used: .*step-000010/__0_0.distcp does not match "
        r"its checksum",
    ):
        resolve_resume(str(ckpts / "step-000010"), tmp_path / "run")
    (ckpts / "step-000010" / CHECKSUMS).unlink()
    assert resolve_resume(str(ckpts / "step-000010"), tmp_path / "run2") == str(ckpts / "step-000010")


def test_a_fresh_run_into_a_run_dir_with_checkpoints_is_refused_before_any_work(reference, tmp_path):
    """A second run into the same run_dir without resume (a notebook cell run again) would train and then fail at
    its first save; a replica group started again rejoins without resume, by design."""
    from lit_titan.job.resume import resolve_resume

    _copy(reference, tmp_path)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest step-000020\).*resume=auto"):
        resolve_resume(None, tmp_path)
    assert resolve_resume(None, tmp_path, rejoins=True) is None
    assert resolve_resume(None, tmp_path / "elsewhere") is None


@pytest.mark.parametrize("override", [("model.dim", 128), ("model.vocab_size", 1024), ("data.seq_len", 64)])
def test_resume_of_another_model_is_refused_naming_the_key(reference, tmp_path, override):
    from lit_titan.checkpoint.compat import fingerprint
    from lit_titan.job.resume import resolve_resume
    from lit_titan.models.llama3 import ModelArgs

    ckpt = reference / "checkpoints" / "step-000010"
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512)
    same = fingerprint(args, 32)
    assert resolve_resume(str(ckpt), tmp_path, same) == str(ckpt)
    key, value = override
    other = {**same, key: value}
    with pytest.raises(
        CheckpointError,
        match=f"^{key}={value}: the checkpoint step-000010 .* was saved with "
        f"{key}={same[key]}; resume with {key}={same[key]}",
    ):
        resolve_resume(str(ckpt), tmp_path, other)


def test_prune_keeps_the_newest_k_and_only_old_partials(tmp_path):
    for name in ("step-000001", "step-000002", "step-000003", "step-000001.partial", "step-000004.partial"):
        (tmp_path / name).mkdir()
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003", "step-000004.partial"]


@pytest.mark.parametrize("make", ["incomplete", "truncated"])
def test_damaged_resume_path_is_refused_with_the_reason(reference, tmp_path, make):
    from lit_titan.job.resume import resolve_resume

    ckpt = tmp_path / "step-000004"
    if make == "incomplete":  # shards written, .metadata never published
        ckpt.mkdir()
        (ckpt / "__0_0.distcp").write_bytes(b"partial")
    else:
        ckpt = _copy(reference, tmp_path) / "step-000020"
        _truncate_a_shard(ckpt)
    with pytest.raises(CheckpointError, match="resume=.* cannot be used: .*(no .metadata|truncated)"):
        resolve_resume(str(ckpt), tmp_path / "run")


@pytest.mark.parametrize("make", ["missing", "newer-exist", "tampered"])
def test_bad_resume_is_refused_before_training(reference, tmp_path, make):
    """Through the command line: one error line, exit 2, nothing started, no payload run."""
    ckpt = tmp_path / "step-000004"
    run_dir = tmp_path / "run"
    marker = tmp_path / "payload-ran"
    if make == "newer-exist":  # resuming an old step into a run that has newer ones would overwrite them
        ckpt = _copy(reference, run_dir) / "step-000010"
    elif make == "tampered":
        ckpt = _copy(reference, tmp_path) / "step-000020"
        _tamper_an_entry(ckpt, marker)
    proc = run_cli([*COMMON, f"resume={ckpt}"], run_dir, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-titan: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    if make == "tampered":
        assert "entry optimizer_0.param_groups.0.params holds more than tensors and plain data" in errors[0]
    assert not marker.exists()
    assert not (run_dir / "metrics.csv").exists()  # nothing started
