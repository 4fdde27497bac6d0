"""A callback that records each rank's gradient storage at every micro-batch boundary.

The step runner trains a step's micro-batches inside one Lightning batch (strategies/step.py), so the probe
records after each of its ``train_part`` calls (each micro-batch's backward) and at the batch's end.

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
        self.micro_batches = 0
        self.per_step = 0

    def _record(self, trainer: pl.Trainer, module: pl.LightningModule, where: str) -> None:
        self.records.append(
            {
                "where": where,
                "step": trainer.global_step,
                "micro_batch": self.micro_batches - 1,
                "bytes": gradient_storage_bytes([module.model]),
            }
        )

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        runner = trainer.strategy.step_runner
        original = runner.train_part

        def train_part(*args, **kwargs):
            loss = original(*args, **kwargs)
            self.micro_batches += 1
            self._record(trainer, module, "after_backward")
            return loss

        runner.train_part = train_part  # this run's strategy only (an attribute of its instance)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args) -> None:
        self.per_step = module._micro_batches_per_batch
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
                    "accumulation": self.per_step,
                    "model_grad_bytes": total,
                    "records": self.records,
                }
            )
        )
