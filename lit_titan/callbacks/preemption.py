"""Preemption: SIGTERM or SIGUSR1 on any rank, or the data store gone mid-run, ends the job with its work saved.

A signal may reach one rank only (``kill``, a spot instance's agent, Slurm's ``--signal`` to the batch
step), so every rank reports its local reason in a max all-reduce of three integers at each
optimizer-step boundary, on a gloo group (a CPU tensor: no GPU work and no host sync on the training
stream). When the agreed value says stop, every rank saves the checkpoint of the step just completed,
waits until it is published, rank 0 prints one line (the step saved, the command that continues),
and the job exits with ``REQUEUE_EXIT_CODE``.

Both a signal and a data-store outage (``request_stop``: the reader fetches the next optimizer step's
batches ahead, and gave up after bounded retries) stop at the end of the optimizer step under way,
where the periodic checkpoints are saved too, so resuming from that checkpoint is exact.

Lightning's own SIGTERM handling is replaced for the fit (and restored by Lightning's teardown): it
runs a collective inside the signal handler, which mismatches the other ranks' collectives when only
one rank got the signal, and its loop then raises ``SystemExit`` (exit code 0) on that rank alone,
in the middle of gradient accumulation. Lightning's SLURM environment still decides whether the job
requeues itself (``SLURMEnvironment(auto_requeue=True)``, its default, on its ``requeue_signal``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import lightning as L

from lit_titan.errors import REQUEUE_EXIT_CODE, Preempted
from lit_titan.strategies.contract import contract

__all__ = ["Preempted", "Preemption", "REQUEUE_EXIT_CODE", "request_stop"]

_NONE, _SIGNAL, _OUTAGE = 0, 1, 2  # the agreed value is the max: an outage stops at once
_local: dict[str, Any] = {"code": _NONE, "reason": ""}


def request_stop(reason: str, outage: bool = True) -> None:
    """Ask every rank to save and stop at the next batch (called by a data reader that gave up)."""
    code = _OUTAGE if outage else _SIGNAL
    if code > _local["code"]:
        _local.update(code=code, reason=reason)


def stop_requested() -> bool:
    return _local["code"] != _NONE


class Preemption(L.Callback):
    """Installed by ``lit_titan.train`` on every run.

    ``continue_command``: the command that resumes this run (``resume=auto``), printed in the line.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, continue_command: str | None = None) -> None:
        self.continue_command = continue_command
        self._group: Any = None
        self._own_group = False
        self._flag: Any = None
        self._signum: int | None = None
        self.agree_seconds = 0.0  # time spent in the agreement all-reduce (reported by tests/benchmarks)
        self.agreements = 0
        self._last_step = -1

    # ---- setup ---------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import torch
        import torch.distributed as dist

        _local.update(code=_NONE, reason="")
        self._flag = torch.zeros(3, dtype=torch.int32)  # [reason, signal number, signalled rank + 1]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                self._group = dist.group.WORLD
            else:  # NCCL: a CPU gloo group beside it, so the flag never touches the GPU stream
                self._group, self._own_group = dist.new_group(backend="gloo"), True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        if self._own_group and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group, self._own_group = None, False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        # Lightning's flag is never set while these handlers are installed: its per-batch broadcast of it
        # (amortised to logging steps by lit_titan.observe.log_cadence) would be a collective and a host sync
        # (``.item()``) on the GPU that carries nothing.
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = lambda: None
        # After Lightning registered its handlers (Trainer._run); its teardown restores the originals.
        if threading.current_thread() is threading.main_thread():  # Python allows handlers there only
            for signum in self._signals(trainer):
                signal.signal(signum, self._on_signal)

    def _signals(self, trainer: L.Trainer) -> set[int]:
        env = contract(trainer.strategy).cluster_environment
        requeue = getattr(env, "requeue_signal", None)
        return {*self.SIGNALS, *([requeue] if requeue is not None else [])}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: no I/O and no collective in a signal handler.
        if self._signum is None:
            self._signum = signum
        request_stop(f"{signal.Signals(signum).name}", outage=False)

    # ---- the agreement -------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # At an optimizer-step boundary only, where Checkpointing saves too (its hook ran before this
        # one): Lightning's LR schedulers and loop counters then hold what an exact resume expects.
        step = trainer.global_step
        if step == self._last_step:
            return  # gradient accumulation: the optimizer step is still under way
        self._last_step = step
        agreed = self._agree()
        if agreed != _NONE and not (trainer.max_steps > 0 and step >= trainer.max_steps):
            self._stop(trainer, agreed, int(self._flag[1]), int(self._flag[2]) - 1)

    def _agree(self) -> int:
        import torch.distributed as dist

        self._flag[0] = _local["code"]
        self._flag[1] = self._signum or 0
        self._flag[2] = _rank() + 1 if self._signum else 0
        if self._group is not None:
            start = time.perf_counter()
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            self.agree_seconds += time.perf_counter() - start
            self.agreements += 1
        return int(self._flag[0])

    # ---- save, say, exit -----------------------------------------------------------------------
    def _stop(self, trainer: L.Trainer, agreed: int, signum: int, signalled_rank: int) -> None:
        from lit_titan.callbacks.checkpointing import Checkpointing

        step = trainer.global_step
        ckpt = next((cb for cb in trainer.callbacks if isinstance(cb, Checkpointing)), None)
        saved, why_not = None, "checkpoint.enabled=false"
        if ckpt is not None:
            if ckpt._last_saved != step:
                ckpt.save(trainer)
            trainer.strategy.checkpoint_writer.wait()  # published (every rank's shards) before anyone exits
            saved, why_not = ckpt.dirpath / _step_dir(step), "no optimizer step completed since the start"
        why = self._why(agreed, signum, signalled_rank)
        if saved is not None and saved.is_dir():
            line = f"lit-titan: {why}: saved the checkpoint of step {step} in {saved}"
        else:
            line = f"lit-titan: {why} at step {step}; nothing new to save ({why_not})"
        if self.continue_command and ckpt is not None:
            line += f"; continue with: {self.continue_command}"
        line += f" (exit code {REQUEUE_EXIT_CODE}: requeue)"
        if trainer.is_global_zero:
            print(line, file=sys.stderr, flush=True)
            _slurm_requeue(trainer, signum)
        raise Preempted(line, wait_for_parent=_launcher_pid(trainer))

    @staticmethod
    def _why(agreed: int, signum: int, signalled_rank: int) -> str:
        if agreed == _OUTAGE:
            return _local["reason"] if _local["code"] == _OUTAGE else "the data store stopped answering on another rank"
        return f"preempted ({signal.Signals(signum).name} on rank {signalled_rank})"


def _step_dir(step: int) -> str:
    from lit_titan.checkpoint import step_dir_name

    return step_dir_name(step)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _launcher_pid(trainer: L.Trainer) -> int | None:
    """A rank that Lightning's own launcher started: its parent (rank 0) must exit first.

    Why: the launcher's child-process observer SIGKILLs rank 0 when a child exits non-zero first,
    and rank 0's exit code is the job's.
    """
    from lightning.fabric.plugins.environments import LightningEnvironment

    env = contract(trainer.strategy).cluster_environment
    if type(env) is LightningEnvironment and trainer.local_rank > 0:
        return os.getppid()
    return None


def _slurm_requeue(trainer: L.Trainer, signum: int | None) -> None:
    """``scontrol requeue`` the job, as Lightning's ``_SignalConnector._slurm_sigusr_handler_fn`` does.

    Only where Lightning would: under its ``SLURMEnvironment`` with ``auto_requeue`` on its
    ``requeue_signal``. Written out because Lightning's function also saves a second checkpoint of
    its own inside the signal handler; this is its job-id and ``scontrol`` part.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = contract(trainer.strategy).cluster_environment
    if not (isinstance(env, SLURMEnvironment) and env.auto_requeue and signum == env.requeue_signal):
        return
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job_id):
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job_id])
    except OSError as err:  # no scontrol on this node's PATH
        result = err.strerror
    print(
        f"lit-titan: scontrol requeue {job_id}: " + ("requeued" if result == 0 else f"failed ({result})"),
        file=sys.stderr,
        flush=True,
    )
