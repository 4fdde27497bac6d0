"""Failure observability: hang watchdog, straggler report, non-finite guard.

The multi-process tests run real gloo jobs (no mocked torch.distributed) through
``tests/support/scripts/fault_job.py``, which injects the fault with a test-only callback.
"""

from __future__ import annotations

import csv
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lit_titan
from helpers import TINY, read_metrics, run_job
from lit_titan.callbacks import WATCHDOG_EXIT_CODE, NonFiniteError, NonFiniteGuard, StragglerReport, Watchdog
from lit_titan.callbacks.straggler import straggler_stats
from paths import SCRIPTS

MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
TWO_RANKS = [*TINY, "cluster.devices=2", "checkpoint.enabled=false", "seed=0"]


# ---- watchdog ------------------------------------------------------------------------------------
class _NoExit(Watchdog):
    """Records the exit instead of ending pytest's process (the real exit is tested in a subprocess)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fired = threading.Event()

    def _exit(self) -> None:
        self.fired.set()


def _trainer(run_dir: Path, step: int = 3) -> SimpleNamespace:
    return SimpleNamespace(global_rank=0, default_root_dir=str(run_dir), global_step=step)


class _Clock:
    """The watchdog's monotonic clock, moved by the test: what it must decide (fire or not) depends on
    elapsed time only, so a loaded machine that delays a thread cannot make it fire early or late. The
    watchdog thread itself runs for real (its polls, the dump, the exit hook); the subprocess tests
    below check real-time firing."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    sleep, strftime = staticmethod(time.sleep), staticmethod(time.strftime)


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    import lit_titan.callbacks.watchdog as watchdog_module

    fake = _Clock()
    monkeypatch.setattr(watchdog_module, "time", fake)
    return fake


def _polls(dog: Watchdog, n: int = 4) -> None:
    """Let the watchdog thread poll about ``n`` times (real time; nothing depends on it being exact)."""
    time.sleep(n * dog.poll_interval_s)


def test_watchdog_dumps_every_thread_after_timeout_and_not_while_beating(tmp_path, clock):
    dog = _NoExit(timeout_s=0.6, poll_interval_s=0.02, exit_delay_s=0, backstop_s=None)
    trainer = _trainer(tmp_path)
    dog.on_train_start(trainer, None)
    try:
        for i in range(8):  # 1.6 s of beats, each well within the timeout
            clock.advance(0.2)
            if i % 2:
                dog.on_train_batch_end(trainer, None, None, None, 0)
            else:
                Watchdog.heartbeat("a checkpoint writer")  # code without a reference to the callback
            _polls(dog, 2)
        with dog.paused():  # a long synchronous save
            clock.advance(1.0)
            _polls(dog)
        _polls(dog)
        assert not dog.fired.is_set() and not (tmp_path / "hang").exists()
        clock.advance(0.5)  # 0.5 s since the last progress: within the timeout
        _polls(dog)
        assert not dog.fired.is_set()
        clock.advance(0.2)
        assert dog.fired.wait(timeout=10)
    finally:
        dog.stop()
    stacks = (tmp_path / "hang" / "stacks-rank0.txt").read_text()
    assert "MainThread" in stacks and "lit-titan-watchdog" in stacks
    assert "test_watchdog_dumps_every_thread_after_timeout_and_not_while_beating" in stacks  # the main thread
    info = json.loads((tmp_path / "hang" / "rank0.json").read_text())
    assert info["global_step"] == 3 and info["exit_code"] == WATCHDOG_EXIT_CODE
    assert info["seconds_since_progress"] == pytest.approx(0.7)
    assert info["last_progress"] == "resumed after a paused block"


def test_watchdog_first_step_allowance_and_stop(tmp_path, clock):
    dog = _NoExit(timeout_s=0.3, first_step_timeout_s=5.0, poll_interval_s=0.02, backstop_s=None)
    dog.on_train_start(_trainer(tmp_path), None)
    clock.advance(0.8)  # a slow first step: within first_step_timeout_s
    _polls(dog)
    assert not dog.fired.is_set()
    dog.teardown(None, None, "fit")
    assert not dog.running
    with pytest.raises(ValueError, match="non-zero"):
        Watchdog(exit_code=0)


@pytest.mark.slow
def test_watchdog_backstop_fires_when_the_gil_is_held(tmp_path):
    """A main thread that never releases the GIL starves the Python watchdog: faulthandler's C thread dumps."""
    # A job that hangs fails run_job's timeout (the whole job is killed and the test fails with its output).
    proc = run_job([sys.executable, str(SCRIPTS / "watchdog_backstop.py"), str(tmp_path)], timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "spin_holding_the_gil" in proc.stderr and "Timeout" in proc.stderr


@pytest.mark.slow
def test_watchdog_fires_on_a_hang_in_a_two_process_run(tmp_path):
    """Rank 1 stops in Python at step 2; rank 0 blocks in FSDP's all-gather. Both dump, the job exits 75."""
    timeout_s = 6
    # A job the watchdog fails to end fails run_job's timeout (the whole job is killed, the test fails).
    proc = run_job(
        [
            sys.executable,
            str(SCRIPTS / "fault_job.py"),
            "hang",
            *TWO_RANKS,
            "trainer.max_steps=6",
            "callbacks=[watchdog]",
            f"callbacks.watchdog.timeout_s={timeout_s}",
            "callbacks.watchdog.first_step_timeout_s=120",
            "callbacks.watchdog.exit_delay_s=2",
            f"run_dir={tmp_path}",
        ],
        timeout=200,
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert proc.returncode in (WATCHDOG_EXIT_CODE, -9), proc.returncode  # -9: Lightning's launcher killed rank 0
    hang = tmp_path / "hang"
    stacks = {r: (hang / f"stacks-rank{r}.txt").read_text() for r in (0, 1)}
    assert "hang_here_forever" in stacks[1]  # the frame that hangs
    # the peer waits in the step's first collective: FSDP's all-gather, or the step runner's valid-target count
    assert ("all_gather" in stacks[0] or "work.wait()" in stacks[0]) and "training_step" in stacks[0]
    for r in (0, 1):
        info = json.loads((hang / f"rank{r}.json").read_text())
        assert info["rank"] == r and info["global_step"] == 2 and info["last_progress"] == "train batch end"
        assert timeout_s < info["seconds_since_progress"] < timeout_s + 5
        assert f"lit-titan watchdog: rank {r} made no progress" in proc.stderr
    # The flight recorder: each rank's buffer of collectives, and its newest ones.
    last = {}
    for r in (0, 1):
        info = json.loads((hang / f"rank{r}.json").read_text())
        trace = json.loads((hang / f"fr-trace-rank{r}.json").read_text())
        assert info["flight_recorder"] == str(hang / f"fr-trace-rank{r}.json") and trace["entries"]
        last[r] = info["last_collectives"][-1]
        assert last[r]["collective_seq_id"] == trace["entries"][-1]["collective_seq_id"]
    # rank 0 entered a collective of step 3 (the valid-target count, or FSDP's all-gather) that rank 1 never reached
    assert last[0]["collective_seq_id"] > last[1]["collective_seq_id"], last
    assert any(op in last[0]["profiling_name"] for op in ("all_gather", "allgather", "all_reduce", "allreduce")), last


# ---- straggler report ----------------------------------------------------------------------------
def test_straggler_stats_charge_the_wait_to_the_late_rank():
    # Lock-step: every rank's wall step time is 1.0 s; rank 2 spends 0.5 s more outside the model,
    # so ranks 0, 1 and 3 wait 0.5 s for it inside every step.
    stats = straggler_stats([1.0, 1.0, 1.0, 1.0], [0.1, 0.1, 0.6, 0.1])
    assert stats["slowest_rank"] == 2
    assert stats["slowest_step_s"] == pytest.approx(1.0)
    assert stats["median_step_s"] == pytest.approx(0.5)
    assert stats["ratio_to_median"] == pytest.approx(2.0)
    even = straggler_stats([1.0, 1.0], [0.2, 0.2])
    assert even["slowest_rank"] == 0 and even["ratio_to_median"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        StragglerReport(every_n_steps=0)


@pytest.mark.slow
def test_straggler_report_and_nonfinite_skip_in_a_two_process_run(tmp_path):
    """Rank 1 sleeps 0.5 s before every batch and, at step 5, puts a NaN into its own gradient shard only.

    One launch checks both: the report names rank 1 at both reports (steps 4 and 8) and warns; the
    guard skips step 5 on *both* ranks (one all-reduced decision), which leaves every rank's
    parameter shard and optimizer state untouched while step 4 changed them, and training finishes.
    """
    proc = run_job(
        [
            sys.executable,
            str(SCRIPTS / "fault_job.py"),
            "straggle",
            *TWO_RANKS,
            "trainer.max_steps=8",
            "callbacks=[straggler,timeline]",
            "nonfinite.action=skip_step",
            "callbacks.straggler.every_n_steps=4",
            f"run_dir={tmp_path}",
        ],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path)
    reports = [r for r in rows if r.get("straggler/slowest_rank")]
    assert [int(r["step"]) for r in reports] == [3, 7]  # optimizer steps 4 and 8; not repeated in other rows
    for r in reports:
        assert float(r["straggler/slowest_rank"]) == 1.0
        assert float(r["straggler/ratio_to_median"]) > 1.2
        assert float(r["straggler/slowest_step_s"]) > float(r["straggler/median_step_s"]) + 0.15
    assert proc.stderr.count("lit-titan straggler: rank 1 is the slowest") == 2
    # with the timeline, the warning says where: rank 1's sleep is before its forward, i.e. data wait
    assert proc.stderr.count("timeline: its phase furthest over the median is data") == 2, proc.stderr[-3000:]

    skipped = [float(r["train/skipped_steps"]) for r in rows if r.get("train/skipped_steps")]
    assert skipped == [0.0] * 5 + [1.0] * 3
    assert [r["train/grad_norm"] for r in rows if r.get("train/grad_norm")][5] == "nan"
    assert "NonFiniteGuard skipped optimizer step 5: non-finite grad norm nan" in (proc.stdout + proc.stderr)
    for rank in (0, 1):
        check = json.loads((tmp_path / f"skipcheck-rank{rank}.json").read_text())
        assert check["4"] == {"params_unchanged": False, "optimizer_state_unchanged": False}, (rank, check)
        assert check["5"] == {"params_unchanged": True, "optimizer_state_unchanged": True}, (rank, check)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))


# ---- non-finite guard ----------------------------------------------------------------------------
class _NaNAt(lit_titan.PretrainModule):
    """Loss NaN (hence gradients NaN) at the given steps; or only one gradient NaN with grad_only."""

    def __init__(self, nan_steps: set[int], grad_only: bool = False) -> None:
        super().__init__("llama3_debug", MODEL, {"warmup_steps": 1})
        self.nan_steps, self.grad_only = nan_steps, grad_only

    def compute_loss(self, logits, labels):
        loss = super().compute_loss(logits, labels)
        return loss * float("nan") if self.global_step in self.nan_steps and not self.grad_only else loss

    def on_after_backward(self) -> None:
        if self.global_step in self.nan_steps and self.grad_only:
            self.model.output.weight.grad[0, 0] = float("inf")


class _Snapshots(L.Callback):
    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]


def _fit(
    tmp_path: Path, module: L.LightningModule, guard: NonFiniteGuard, steps: int = 4, *callbacks: L.Callback
) -> L.Trainer:
    torch.manual_seed(0)
    batches = [torch.randint(0, 512, (4, 33)) for _ in range(steps)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[guard, *callbacks],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return trainer


def test_nonfinite_skip_leaves_weights_and_optimizer_state_untouched_and_training_continues(tmp_path):
    guard, snaps = NonFiniteGuard(action="skip_step", max_consecutive_skips=2), _Snapshots()
    module = _NaNAt({2})
    trainer = _fit(tmp_path, module, guard, 4, snaps)
    assert trainer.global_step == 4 and guard.skipped_at == [2] and guard.skipped_steps == 1
    for step in range(4):
        same = all(torch.equal(a, b) for a, b in zip(snaps.before[step], snaps.after[step]))
        assert same == (step == 2), step  # only the poisoned step left the weights as they were
    assert all(torch.isfinite(p).all() for p in module.parameters())
    state_steps = {float(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert state_steps == {3.0}  # AdamW counted 3 updates of 4 steps: the skipped one left its state alone
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/skipped_steps")]
    assert [float(r["train/skipped_steps"]) for r in rows] == [0.0, 0.0, 1.0, 1.0]
    # The module still saw the step's real gradients: its logged norm shows why the step was skipped.
    assert [r["train/grad_norm"] == "nan" for r in rows] == [False, False, True, False]
    assert not guard._hooks  # the optimizer hook is removed at teardown


def test_nonfinite_stop_names_the_step_and_the_quantity(tmp_path):
    snaps = _Snapshots()
    with pytest.raises(
        NonFiniteError,
        match=r"^non-finite loss nan, grad norm nan at optimizer step 1: stopped "
        r"before the update",
    ):
        _fit(tmp_path, _NaNAt({1}), NonFiniteGuard(), 3, snaps)  # action=stop is the default
    assert 1 not in snaps.after  # the step never completed: its update was not applied
    with pytest.raises(NonFiniteError, match=r"^non-finite grad norm inf at optimizer step 2: "):
        _fit(tmp_path / "grad", _NaNAt({2}, grad_only=True), NonFiniteGuard(action="stop"), 3)


def test_nonfinite_skip_stops_after_max_consecutive_skips(tmp_path):
    guard = NonFiniteGuard(action="skip_step", max_consecutive_skips=2)
    with pytest.raises(NonFiniteError, match="2 consecutive steps skipped"):
        _fit(tmp_path, _NaNAt({1, 2, 3}), guard, 5)
    assert guard.skipped_at == [1, 2]
    with pytest.raises(ValueError, match="skip"):
        NonFiniteGuard(action="ignore")


# ---- a diverging run: stopped before the update, and no non-finite checkpoint ------------------
DIVERGE = [
    *TINY,
    "cluster.devices=2",
    "seed=0",
    "precision=32-true",
    "optim.lr=1000",
    "trainer.max_steps=12",
    "checkpoint.every_n_steps=1",
    "checkpoint.keep_last=2",
]


def _checkpoints_finite(ckpts: Path, tmp_path: Path) -> list[str]:
    """The published checkpoints, each checked to load with every tensor finite."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lit_titan.checkpoint import published, validate
    from lit_titan.checkpoint.staging import local_tensors

    names = []
    for ckpt in published(ckpts):
        validate(ckpt)
        dcp_to_torch_save(ckpt, tmp_path / f"{ckpt.name}.pt")
        state = torch.load(tmp_path / f"{ckpt.name}.pt", weights_only=True)
        tensors = [t for _, t in local_tensors(state) if t.is_floating_point()]
        assert tensors and all(torch.isfinite(t).all() for t in tensors), ckpt
        names.append(ckpt.name)
    assert not list(ckpts.glob("*.partial")), sorted(p.name for p in ckpts.iterdir())
    return names


@pytest.mark.slow
def test_a_diverging_run_stops_before_the_update_and_never_publishes_a_nonfinite_checkpoint(tmp_path, worlds):
    """optim.lr=1000 with a checkpoint every step, keep_last=2, two ranks.

    Guard on (the default): the run stops at the first non-finite step, before its update, with one
    line naming the step and the value; the two newest checkpoints are the steps just before it, finite.
    Guard off: the updates turn the state NaN, and the save-time check refuses the first such save on
    every rank before it prunes anything: the two good checkpoints before it stay.
    """
    guarded = worlds.run(2, "scripts.nonfinite_run:main", [*DIVERGE, f"run_dir={tmp_path / 'guard'}"]).value
    line = guarded["stopped"]
    assert line and line.startswith("non-finite ") and "\n" not in line, line
    step = int(line.split(" at optimizer step ")[1].split(":")[0])
    assert "stopped before the update" in line and ("loss nan" in line or "grad norm nan" in line), line
    # every step before `step` was saved (the last one at `step`: the state before the bad update)
    assert _checkpoints_finite(tmp_path / "guard" / "checkpoints", tmp_path) == [
        f"step-{step - 1:06d}",
        f"step-{step:06d}",
    ]

    unguarded = worlds.run(
        2, "scripts.nonfinite_run:main", [*DIVERGE, "nonfinite.enabled=false", f"run_dir={tmp_path / 'off'}"]
    ).value
    line = unguarded["stopped"]
    assert line and "not written: the state is not finite" in line and "nothing was pruned" in line, line
    refused = int(line.split("checkpoint step-")[1].split(" ")[0])
    assert refused > step  # the guard stopped earlier than the NaN state reached a save
    assert _checkpoints_finite(tmp_path / "off" / "checkpoints", tmp_path) == [
        f"step-{refused - 2:06d}",
        f"step-{refused - 1:06d}",
    ]


def test_nonfinite_error_is_one_line_and_exit_code_3(capsys):
    """The command line's handling of the guard's stop: one line on stderr, exit code 3, no traceback."""
    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import user_errors
    from lit_titan.errors import NONFINITE_EXIT_CODE

    def stopped() -> None:
        raise NonFiniteError("non-finite loss nan at optimizer step 6: stopped before the update")

    with pytest.raises(SystemExit) as exit_:
        run_entry_point(stopped, user_errors, rank_failures=True)
    assert exit_.value.code == NONFINITE_EXIT_CODE == 3
    err = capsys.readouterr().err
    assert err == "lit-titan: error: non-finite loss nan at optimizer step 6: stopped before the update\n", err
