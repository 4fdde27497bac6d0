"""A Trainer back after ``fit``: ``trainer.validate``, ``test``, ``predict`` and ``save_checkpoint`` on the same Trainer.

``main(out, fresh_weights=False, layout=None)`` trains 3 steps of the tiny Llama with the Python API (the module
made under ``trainer.init_module(empty_init=True)``, Lightning's CSV logger on; ``layout``:
None for data parallelism over the world, or ``"tp"``/``"pp"`` for tp2/pp2), validating at the last step, then
validates, tests and predicts on the same Trainer and saves a checkpoint with it; Lightning's ``ModelCheckpoint``
saves every step with ``save_last=True``. Saves the validation losses, the test loss, the loss of the predicted
logits (or the line predict was refused with), whether the save wrote a checkpoint and what the checkpoint folder
holds (tests/unit/strategies/test_lightning_conventions.py). ``fresh_weights`` undoes the re-entry (the strategy
parallelises and initialises the model again), the bug the test must catch.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_titan import PretrainModule, TitanStrategy
from scripts.single_file_resume import tiny_data, tiny_llama


class OwnHooks(PretrainModule):
    """A subclass with Lightning hooks of its own (not the step, which the strategy runs): they run on every layout."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.log("user/batches", float(batch_idx + 1))

    def on_validation_epoch_end(self) -> None:
        self.log("user/validations", 1.0, sync_dist=True)


def main(out: str, fresh_weights: bool = False, layout: str | None = None) -> None:
    data = tiny_data()
    strategy = TitanStrategy(**({layout: 2} if layout else {}))
    if fresh_weights:
        strategy._reentered = lambda: False  # the mutant: every Trainer entry builds the model anew
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_steps=3,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        strategy=strategy,
        precision="32-true",
        logger=CSVLogger(Path(out).parent / "logs"),
        log_every_n_steps=1,
        callbacks=[ModelCheckpoint(dirpath=Path(out).parent / "ckpt", every_n_train_steps=1, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=True):  # built on the meta device; the strategy materialises it
        module = tiny_llama(OwnHooks)
    trainer.fit(module, datamodule=data)
    in_fit = float(trainer.callback_metrics["val/loss"])
    user = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("user/")}
    after = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"])
    tested = float(trainer.test(module, datamodule=data, verbose=False)[0]["test/loss"])
    try:
        logits = trainer.predict(module, datamodule=data)
        labels = [module.split_batch(b)[1] for _, b in zip(range(2), data.predict_dataloader())]
        predicted = torch.stack([F.cross_entropy(x.flatten(0, 1), y.flatten()) for x, y in zip(logits, labels)])
        predicted = float(predicted.mean())
    except RuntimeError as err:
        predicted = str(err)
    ckpt = Path(out).with_suffix(".ckpt")
    trainer.save_checkpoint(ckpt)
    if trainer.global_rank == 0:
        kept = sorted(p.name for p in (Path(out).parent / "ckpt").iterdir())
        torch.save(
            {
                "in_fit": in_fit,
                "user": user,
                "after_fit": after,
                "test": tested,
                "predicted": predicted,
                "saved": ckpt.exists(),
                "kept": kept,
                "ckpt_dir": str(Path(out).parent / "ckpt"),
            },
            out,
        )
