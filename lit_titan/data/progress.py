"""``DataProgress``: tokens and epochs per data source in metrics.csv, and a line when a source repeats.

Why a callback: the counts are a pure function of the optimizer step (``GlobalBatches``), so
they cost nothing to compute on a logging step and need no communication; a datamodule has no
logging hook of its own.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_titan.data.datamodule import PretrainDataModule
from lit_titan.observe.log_cadence import forget_logged, is_logging_step


class DataProgress(L.Callback):
    """Logs ``data/tokens/<source>`` and ``data/epoch/<source>`` on logging steps."""

    def __init__(self) -> None:
        self._epochs: list[int] | None = None
        self._prev_global_step = -1

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Re-count the checkpoint's batches in this run's micro-batches (runs before Lightning restores its loops).

        Lightning resumes mid-epoch by batch index and steps the optimizer when
        ``(batch_idx + 1) % accumulate_grad_batches == 0``; a checkpoint taken at optimizer step
        ``s`` under another accumulation would misplace every later step boundary. The step is a
        count of optimizer steps, so it places the next batch for any accumulation.
        """
        try:
            loop = checkpoint["loops"]["fit_loop"]
            progress = loop["epoch_loop.batch_progress"]
        except (KeyError, TypeError):
            return
        step = int(checkpoint.get("global_step", 0))
        accumulation = max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
        if step <= 0:
            return
        saved_batches = max(int(progress["total"]["ready"]), 1)
        saved_accumulation = max(1, round(saved_batches / step))
        epoch_steps = round(int(progress["current"]["ready"]) / saved_accumulation)
        for key, steps in (("total", step), ("current", epoch_steps)):
            for field in progress[key]:
                # saved in on_train_batch_end: the last batch processed, not yet "completed" (Lightning
                # completes it on restart)
                progress[key][field] = steps * accumulation - (field == "completed")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prev_global_step = trainer.global_step  # (resumed) start: no step has ended yet

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        forget_logged(trainer, "data/")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._prev_global_step:
            return  # inside an accumulation window: the step's last micro-batch logs
        self._prev_global_step = trainer.global_step
        dm = trainer.datamodule
        batches = dm.train_batches if isinstance(dm, PretrainDataModule) else None
        if batches is None or not is_logging_step(trainer, trainer.global_step):
            return
        consumed = batches.blend.consumed_at(trainer.global_step)
        epochs = [int(c // max(1, o.per_epoch)) for c, o in zip(consumed, batches.orders)]
        names = dm.source_names
        if self._epochs is not None:
            for name, old, new in zip(names, self._epochs, epochs):
                if new > old:
                    rank_zero_info(f"data: source {name} finished epoch {old}; repeating it (epoch {new})")
        self._epochs = epochs
        for name, count, epoch in zip(names, consumed, epochs):
            pl_module.log(f"data/tokens/{name}", float(count * dm.seq_len), on_step=True, on_epoch=False)
            pl_module.log(f"data/epoch/{name}", float(epoch), on_step=True, on_epoch=False)
