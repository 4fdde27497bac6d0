"""A callback that records each rank's gradient storage at every micro-batch boundary.

Used through the real command line: ``PYTHONPATH=tests/support/scripts python -m lit_titan.train ...
+callbacks.grad_probe._target_=grad_memory_probe.GradMemoryProbe +callbacks.grad_probe.out=DIR``;
every rank writes ``DIR/rank<R>.json`` when training ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl

from lit_titan.strategies.fsdp import gradient_storage_bytes


class GradMemoryProbe(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.records: list[dict] = []

    def _record(self, trainer: pl.Trainer, module: pl.LightningModule, where: str) -> None:
        self.records.append(
            {
                "where": where,
                "step": trainer.global_step,
                "micro_batch": trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1,
                "bytes": gradient_storage_bytes([module.model]),
            }
        )

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._record(trainer, module, "after_backward")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args) -> None:
        self._record(trainer, module, "batch_end")

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # the whole model's gradients at the parameters' dtype (DTensor.numel() is the global size)
        total = sum(p.numel() * p.element_size() for p in module.model.parameters())
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(
            json.dumps(
                {
                    "rank": trainer.global_rank,
                    "world_size": trainer.world_size,
                    "accumulation": trainer.accumulate_grad_batches,
                    "model_grad_bytes": total,
                    "records": self.records,
                }
            )
        )
