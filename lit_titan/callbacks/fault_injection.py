"""Kill a rank on purpose, for tests and recovery drills (``fault.kill_rank``, ``fault.at_step``).

Fires in the first attempt only (under torchrun the attempt all nodes agree on, ``TitanStrategy.restart_attempt``;
else ``TORCHELASTIC_RESTART_COUNT``/``LIT_TITAN_ATTEMPT`` 0 or unset), so a
job launched with ``torchrun --max-restarts=N`` dies once, restarts, resumes from the newest
complete checkpoint and finishes. ``during_save`` kills the rank while the checkpoint of
``at_step`` is being written, i.e. after its shards started but before the save was published.
``save_error`` (an errno name such as ``ENOSPC`` or ``EACCES``) instead makes rank ``kill_rank``'s
checkpoint writer raise that ``OSError`` when it starts writing the shards of step ``at_step``, as a
full disk or a permission change would (the other ranks write normally). ``stage_error`` (``ENOMEM``)
makes that rank's copy of its state into host memory fail instead, as an exhausted host would.
``pause`` makes rank ``kill_rank`` wait at step ``at_step`` (printing its pid) until it receives SIGTERM
or SIGUSR1 (a preemption drill whose signal arrives at a known step, however loaded the machine), or
SIGCONT (go on: e.g. after the drill stopped the data store).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L

from lit_titan.callbacks.settings import FaultConfig
from lit_titan.checkpoint.layout import staged_step
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import contract


class FaultInjection(L.Callback):
    def __init__(self, settings: FaultConfig | None = None, **keys: Any) -> None:
        """The ``fault`` group (``FaultConfig``; its ``slow_*`` drill is Preflight's) or its fields by name."""
        s = self.settings = settings_of(FaultConfig, settings, keys)
        if s.kill_rank is None or s.at_step is None:
            raise ValueError("FaultInjection needs kill_rank and at_step (the rank to fail and the step to fail at)")
        self.kill_rank, self.at_step, self.during_save, self.pause = s.kill_rank, s.at_step, s.during_save, s.pause
        self.save_error, self.stage_error = s.save_error, s.stage_error
        for name, value in (("save_error", s.save_error), ("stage_error", s.stage_error)):
            if value is not None and not isinstance(getattr(errno, str(value), None), int):
                raise ValueError(f"fault.{name}={value} is not an errno name (e.g. ENOSPC, ENOMEM)")
        # torchrun counts attempts in TORCHELASTIC_RESTART_COUNT, the Slurm script of
        # `lit-titan launch` in LIT_TITAN_ATTEMPT.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("LIT_TITAN_ATTEMPT") or "0"
        self.armed = int(attempt) == 0
        self._rank = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank = trainer.global_rank
        # Under torchrun the strategy knows the attempt every node agrees on; an agent's own
        # TORCHELASTIC_RESTART_COUNT stays 0 when it restarted only because another node failed.
        attempt = contract(trainer.strategy).restart_attempt
        if attempt is not None:
            self.armed = attempt == 0
        if self.save_error is not None:
            trainer.strategy.checkpoint_writer.on_write_data.append(self._io_error)
        elif self.stage_error is not None:
            trainer.strategy.checkpoint_writer.on_stage.append(self._stage_error)
        elif self.during_save:
            trainer.strategy.checkpoint_writer.on_write_started.append(self._on_save)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        drill = self.during_save or self.save_error is not None or self.stage_error is not None
        if self.pause and trainer.global_step == self.at_step:
            self._pause()
        elif not drill and trainer.global_step == self.at_step:
            self._kill(f"at step {self.at_step}")

    def _pause(self, timeout_s: float = 600.0) -> None:
        import time

        from lit_titan.callbacks.preemption import stop_requested

        if not (self.armed and self._rank == self.kill_rank):
            return
        go_on: list[int] = []
        previous = signal.signal(signal.SIGCONT, lambda signum, frame: go_on.append(signum))
        print(
            f"lit-titan: fault injection: rank {self._rank} (pid {os.getpid()}) paused at step {self.at_step} "
            "until it receives SIGTERM or SIGUSR1 (or SIGCONT: go on)",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not stop_requested() and not go_on and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGCONT, previous)

    def _on_save(self, staging: Path) -> None:
        if staged_step(staging) == self.at_step:
            self._kill(f"while saving the checkpoint of step {self.at_step}")

    def _io_error(self, staging: Path) -> None:
        self._raise(staging, str(self.save_error), f"in rank {self._rank}'s checkpoint writer", str(staging))

    def _stage_error(self, staging: Path) -> None:
        self._raise(staging, str(self.stage_error), f"while rank {self._rank} stages its checkpoint")

    def _raise(self, staging: Path, name: str, where: str, *filename: str) -> None:
        """The drilled rank's ``OSError(name)`` at step ``at_step``, said on stderr first."""
        if self.armed and self._rank == self.kill_rank and staged_step(staging) == self.at_step:
            code = getattr(errno, name)
            print(f"lit-titan: fault injection: {name} {where}", file=sys.stderr, flush=True)
            raise OSError(code, os.strerror(code), *filename)

    def _kill(self, when: str) -> None:
        if self.armed and self._rank == self.kill_rank:
            print(f"lit-titan: fault injection: killing rank {self._rank} {when}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
