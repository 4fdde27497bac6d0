"""When to checkpoint: every N optimizer steps and at the end of training, keeping the newest K.

Before the first step it checks that the run's checkpoints fit on disk (``keep_last`` of them at
once; see ``lit_titan/checkpoint/disk.py``) and stops every rank with one line otherwise.

How a checkpoint is written (sharded, asynchronous, atomically published) is the strategy's
:class:`~lit_titan.checkpoint.CheckpointWriter`; this callback only decides *when* and configures it.
Used instead of Lightning's ``ModelCheckpoint``, which deletes old checkpoints right after starting
a new save (before an asynchronous save has finished) and names files with ``=``, which Hydra's
override grammar cannot take back as ``resume=PATH``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L

from lit_titan.callbacks.settings import CheckpointConfig
from lit_titan.callbacks.watchdog import Watchdog
from lit_titan.checkpoint import step_dir_name
from lit_titan.checkpoint.disk import expected_state, planned_saves
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import contract


class Checkpointing(L.Callback):
    def __init__(
        self,
        dirpath: str,
        settings: CheckpointConfig | None = None,
        *,
        fingerprint: dict[str, Any] | None = None,
        **keys: Any,
    ) -> None:
        """
        Args:
            dirpath: where ``step-XXXXXX`` checkpoint directories go (``<run_dir>/checkpoints``).
            settings: the ``checkpoint`` group (``CheckpointConfig``: every_n_steps, 0 = only at the end;
                keep_last, 0 = keep all; async_save), or its fields by name in ``keys``.
            fingerprint: the config keys a resume must share (``lit_titan.checkpoint.compat``),
                stored in every checkpoint's ``meta.pt``.
        """
        s = self.settings = settings_of(CheckpointConfig, settings, keys)
        if s.every_n_steps < 0 or s.keep_last < 0:
            raise ValueError("checkpoint.every_n_steps and checkpoint.keep_last must be >= 0")
        self.dirpath = Path(dirpath)
        self.every_n_steps = s.every_n_steps
        self.keep_last = s.keep_last
        self.async_save = s.async_save
        self.fingerprint = dict(fingerprint or {})
        self._last_saved = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        writer = contract(trainer.strategy).checkpoint_writer
        if writer is None:
            raise TypeError(f"Checkpointing needs lit_titan's TitanStrategy (got {type(trainer.strategy).__name__})")
        writer.async_save, writer.keep_last = self.async_save, self.keep_last

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.fingerprint:
            from lit_titan.checkpoint.compat import KEY

            checkpoint[KEY] = dict(self.fingerprint)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_saved = trainer.global_step  # a resumed run does not re-save the step it resumed from
        strategy = trainer.strategy
        strategy.checkpoint_writer.preflight(
            self.dirpath,
            expected_state(strategy.model, trainer.optimizers),
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            every_n_steps=self.every_n_steps,
            n_saves=planned_saves(trainer.global_step, trainer.max_steps, self.every_n_steps),
        )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_saved:  # not an optimizer-step boundary (gradient accumulation)
            return
        periodic = self.every_n_steps and step % self.every_n_steps == 0
        if periodic or (trainer.max_steps > 0 and step >= trainer.max_steps):
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_saved:
            self.save(trainer)
        trainer.strategy.checkpoint_writer.wait()

    def save(self, trainer: L.Trainer) -> None:
        writer = trainer.strategy.checkpoint_writer
        writer.wait()  # the previous save; can take a while on slow storage (raises if it failed)
        Watchdog.heartbeat("checkpoint")  # waiting on our own save is progress, not a hang
        start = time.perf_counter()
        trainer.save_checkpoint(self.dirpath / step_dir_name(trainer.global_step), weights_only=False)
        if writer.records:  # what the training loop waited for: state dicts, staging, small files
            writer.records[-1].blocked_s = time.perf_counter() - start
        self._last_saved = trainer.global_step
