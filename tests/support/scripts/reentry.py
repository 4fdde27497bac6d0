"""A Trainer back after ``fit``: ``trainer.validate`` and ``trainer.save_checkpoint`` on the same Trainer.

``main(out, fresh_weights=False)`` trains 3 steps of the tiny Llama with the Python API, validating at the last
step, then validates again on the same Trainer and saves a checkpoint with it; Lightning's ``ModelCheckpoint`` saves
every step with ``save_last=True``. Saves both validation losses, whether the save wrote a checkpoint and what
the checkpoint folder holds (tests/unit/strategies/test_lightning_conventions.py). ``fresh_weights`` undoes the
re-entry (the strategy parallelises and initialises the model again), the bug the test must catch.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule


def main(out: str, fresh_weights: bool = False) -> None:
    module = PretrainModule(
        "llama3_debug",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512},
        {"total_steps": 3, "lr": 1e-2, "warmup_steps": 0},
    )
    data = PretrainDataModule(
        seq_len=32,
        global_batch_size=4,
        max_bytes=300_000,
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        data_dir=os.environ["LIT_TITAN_CACHE"],
    )
    strategy = TitanStrategy()
    if fresh_weights:
        strategy._reentered = lambda: False  # the mutant: every Trainer entry builds the model anew
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_steps=3,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        strategy=strategy,
        precision="32-true",
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=Path(out).parent / "ckpt", every_n_train_steps=1, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    in_fit = float(trainer.callback_metrics["val/loss"])
    after = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"])
    ckpt = Path(out).with_suffix(".ckpt")
    trainer.save_checkpoint(ckpt)
    if trainer.global_rank == 0:
        kept = sorted(p.name for p in (Path(out).parent / "ckpt").iterdir())
        torch.save({"in_fit": in_fit, "after_fit": after, "saved": ckpt.exists(), "kept": kept}, out)
