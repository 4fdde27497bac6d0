"""Steps that do not log read nothing back to the host and run no logging collective.

(Except the non-finite guard, on by default: it decides before every update, one read of three
numbers and, with several ranks, their all-reduce per step; counted exactly, docs/fault_tolerance.md.)

Real runs of ``lit_titan.train`` with counting wrappers (tests/support/scripts/count_host_syncs.py) around
``Tensor.item/.cpu/.tolist/.numpy``, ``torch.cuda.synchronize``, every ``torch.distributed``
collective not issued by the model's own parallelism, and ``LightningModule.log``. With
``trainer.log_every_n_steps=4``, optimizer steps 1-3 and 5-7 must count zero of each; steps 4 and 8
log the same values as a run that logs every step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import TINY, read_metrics, run_job
from paths import SCRIPTS

SCRIPT = SCRIPTS / "count_host_syncs.py"
STEPS = 8
EVERY = 4
# Gradient accumulation 2 (two micro-batches per step), the progress bar on, and the per-step
# callbacks of the fault-tolerance kit next to the default throughput monitor.
RUN = [
    *TINY,
    f"trainer.max_steps={STEPS}",
    "data.global_batch_size=8",
    "trainer.enable_progress_bar=true",
    "callbacks=[throughput,straggler,watchdog]",
    f"callbacks.straggler.every_n_steps={EVERY}",
]
TRAIN_COLUMNS = ("train/loss", "train/grad_norm", "train/lr", "train/tokens_seen")


def _in_process(run_dir: Path, overrides: list[str], monkeypatch, count: bool) -> dict:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from count_host_syncs import SyncCounter
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from lit_titan.config import compose
    from lit_titan.config.compose import RUN_DIR_ENV
    from lit_titan.job.run import train

    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))  # restored after the test
    counter = SyncCounter()
    if count:
        counter.install()
    try:
        train(compose([*overrides, f"run_dir={run_dir}"]), callbacks=[counter])
    finally:
        counter.uninstall()
    return counter.report()


@pytest.fixture(scope="module")
def every_step(tmp_path_factory) -> list[dict[str, str]]:
    """One process, micro-batch 4 (accumulation 2), logging every step: today's rows."""
    run_dir = tmp_path_factory.mktemp("every_step")
    with pytest.MonkeyPatch.context() as mp:
        _in_process(run_dir, [*RUN, "data.micro_batch_size=4", "trainer.log_every_n_steps=1"], mp, count=False)
    rows = read_metrics(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    return rows


def _check_counts(report: dict, who: str, world: int = 1) -> None:
    steps = {int(k): v for k, v in report["steps"].items()}
    assert sorted(steps) == list(range(1, STEPS + 1)), f"{who}: steps seen {sorted(steps)}"
    for step, counts in steps.items():
        # one Lightning batch per optimizer step: the step runner trains its two micro-batches
        assert counts["batches"] == 1, f"{who}: step {step} ran {counts['batches']} batches"
        found = {k: counts[k] for k in ("host_reads", "collectives", "logs")}
        # The non-finite guard (on by default) must decide before every update: exactly its one read of
        # three numbers, and their all-reduce with more than one rank, every step; nothing else.
        guard = {"host_reads": 0, "collectives": 0}
        for text, n in report["callers"].get(str(step), {}).items():
            if "callbacks/nonfinite.py" in text:
                guard[text.split(":")[0]] += n
        assert guard == {"host_reads": 1, "collectives": int(world > 1)}, (who, step, guard)
        found = {k: v - guard.get(k, 0) for k, v in found.items()}
        if step % EVERY:
            assert not any(found.values()), (
                f"{who}: non-logging step {step} has {found}: {report['callers'].get(str(step))}"
            )
        else:  # the counters see what logging steps do: the mechanism is alive
            assert found["host_reads"] and found["logs"] and found["collectives"], (who, step, found)


def _logging_rows(rows: list[dict[str, str]]) -> dict[int, dict[str, str]]:
    """Rows that hold train/* (metrics.csv step = optimizer steps done before the update, 0-based)."""
    return {int(r["step"]): r for r in rows if r.get("train/loss")}


def test_non_logging_steps_read_nothing_and_log_the_same_values(tmp_path, monkeypatch, every_step):
    run_dir = tmp_path / "every4"
    report = _in_process(
        run_dir, [*RUN, "data.micro_batch_size=4", f"trainer.log_every_n_steps={EVERY}"], monkeypatch, count=True
    )
    _check_counts(report, "1 process")

    rows = read_metrics(run_dir)
    assert [int(r["step"]) for r in rows] == [EVERY - 1, 2 * EVERY - 1]  # a row per logging step, nothing else
    reference = _logging_rows(every_step)
    for step, row in _logging_rows(rows).items():
        for column in TRAIN_COLUMNS:  # the same computation, logged at fewer steps: bitwise equal
            assert float(row[column]) == float(reference[step][column]), (step, column)
        assert float(row["perf/tokens_per_sec_per_device"]) > 0
        assert row["straggler/slowest_rank"] != ""


@pytest.mark.slow
def test_two_gloo_processes_issue_no_logging_collective_between_logging_steps(tmp_path, every_step):
    run_dir = tmp_path / "dp2"
    run_dir.mkdir()
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(run_dir),
        *RUN,
        "cluster.devices=2",
        "parallel.dp_shard=2",
        "data.micro_batch_size=2",
        f"trainer.log_every_n_steps={EVERY}",
        f"run_dir={run_dir}",
    ]
    proc = run_job(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        _check_counts(json.loads((run_dir / f"counts-rank{rank}.json").read_text()), f"rank {rank} of 2", 2)

    # The loss logged at a logging step is still the mean over both data-parallel ranks (reduced at
    # that step): it matches one process on the same global batch (parity tolerance, fp32).
    rows = _logging_rows(read_metrics(run_dir))
    reference = _logging_rows(every_step)
    assert sorted(rows) == [EVERY - 1, 2 * EVERY - 1]
    for step, row in rows.items():
        ref = float(reference[step]["train/loss"])
        assert abs(float(row["train/loss"]) - ref) <= 1e-5 * abs(ref), (step, row["train/loss"], ref)
        ref_norm = float(reference[step]["train/grad_norm"])
        assert abs(float(row["train/grad_norm"]) - ref_norm) <= 1e-3 * ref_norm, (step, row["train/grad_norm"])
        assert float(row["train/tokens_seen"]) == float(reference[step]["train/tokens_seen"])


@pytest.mark.slow
def test_pipeline_sums_the_last_stage_loss_only_on_logging_steps(tmp_path, every_step):
    """pp2: the loss lives on the last stage; its all-reduce over the pp group waits for a logging step."""
    run_dir = tmp_path / "pp2"
    run_dir.mkdir()
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(run_dir),
        *RUN,
        "cluster.devices=2",
        "parallel.pp=2",
        "data.micro_batch_size=4",
        f"trainer.log_every_n_steps={EVERY}",
        f"run_dir={run_dir}",
    ]
    proc = run_job(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        _check_counts(json.loads((run_dir / f"counts-rank{rank}.json").read_text()), f"pp rank {rank}", 2)
    rows, reference = _logging_rows(read_metrics(run_dir)), _logging_rows(every_step)
    assert sorted(rows) == [EVERY - 1, 2 * EVERY - 1]
    for step, row in rows.items():  # rank 0 (first stage) writes the row: the summed loss reached it
        ref = float(reference[step]["train/loss"])
        assert abs(float(row["train/loss"]) - ref) <= 1e-5 * abs(ref), (step, row["train/loss"], ref)


# ---- data loading off the critical path on GPU profiles ------------------------------------------
@pytest.mark.parametrize("profile", ["gpu_1", "h100_8", "h100_64", "h100_128", "h100_256", "h100_512"])
def test_gpu_profiles_log_every_10_steps_and_load_in_a_worker(profile):
    from lit_titan.config import compose

    cfg = compose([f"cluster={profile}"])
    assert cfg.trainer.log_every_n_steps >= 10
    assert cfg.data.num_workers == 2  # off the training loop; workers never change the order (below)
    assert cfg.data.pin_memory is None  # -> pinned when the trainer's device is CUDA (below)
    cpu = compose(["cluster=cpu"])
    assert (cpu.trainer.log_every_n_steps, cpu.data.num_workers) == (1, 0)


def test_one_loader_worker_streams_the_same_batches_and_cuda_pins(tmp_path):
    import os
    from types import SimpleNamespace

    import torch

    from lit_titan.data import PretrainDataModule

    dm = PretrainDataModule(
        seq_len=32,
        global_batch_size=8,
        max_bytes=300_000,
        data_dir=os.environ["LIT_TITAN_CACHE"],
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        dp_rank=1,
        dp_size=2,
    )
    dm.prepare_data()
    dm.setup("fit")
    streams = {}
    for workers in (0, 1, 2):
        dm.num_workers = workers
        batches = []
        for i, batch in enumerate(dm.train_dataloader()):
            batches.append(batch)
            if i == 24:
                break
        streams[workers] = torch.cat(batches)
    assert torch.equal(streams[0], streams[1]) and torch.equal(streams[0], streams[2])  # workers never change the order

    assert dm._pin_memory() is torch.cuda.is_available()  # no trainer: as before
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert dm._pin_memory() is True
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert dm._pin_memory() is False
    dm.pin_memory = True
    assert dm._pin_memory() is True
