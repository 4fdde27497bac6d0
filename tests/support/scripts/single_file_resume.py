"""``trainer.fit(ckpt_path=FILE.ckpt)`` under TitanStrategy, FILE a single-file checkpoint of another strategy.

``save(out)``: one process trains the tiny Llama 2 steps under Lightning's default strategy and saves
``out.ckpt`` with ``trainer.save_checkpoint`` (one file); it also writes ``out`` with the full weights and the
optimizer state keyed by parameter name as torch names them (independent of the loader under test).
``resume(out, source, layout)``: TitanStrategy (dp over the world, or ``"tp"``/``"pp"`` 2) fits from that file to
step 3; at the start of training it writes the weights and optimizer state it restored (gathered in full) and the
step it resumed at. ``plain``: the same with the plain LightningModule of ``scripts/plain_module.py``.
(tests/unit/strategies/test_lightning_conventions.py compares them.)
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule
from scripts import plain_module


def tiny_llama(cls: type[PretrainModule] = PretrainModule) -> PretrainModule:
    return cls(
        "llama3_debug",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512},
        {"total_steps": 3, "lr": 1e-2, "warmup_steps": 0},
    )


def tiny_data() -> PretrainDataModule:
    return PretrainDataModule(
        seq_len=32,
        global_batch_size=4,
        max_bytes=300_000,
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        data_dir=os.environ["LIT_TITAN_CACHE"],
    )


def _trainer(strategy, steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_steps=steps,
        strategy=strategy,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )


def _full_state(module: PretrainModule) -> dict:
    """Every weight and the optimizer state by parameter name, in full (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer = module.trainer.optimizers[0]
    return {
        "weights": get_model_state_dict(module, options=full),
        "optimizer": get_optimizer_state_dict(module, optimizer, options=full).get("state", {}),  # rank 0 only
    }


def _fit(trainer: L.Trainer, module: L.LightningModule, ckpt_path: Path | None = None, dp: int = 1) -> None:
    """The tiny Llama on its data module, or the plain module (``scripts/plain_module.py``) on its rows."""
    if isinstance(module, PretrainModule):
        trainer.fit(module, datamodule=tiny_data(), ckpt_path=ckpt_path)
    else:
        rows = plain_module._data(4 // dp)
        trainer.fit(module, train_dataloaders=rows, val_dataloaders=rows, ckpt_path=ckpt_path)


def save(out: str, plain: bool = False) -> None:
    module, trainer = plain_module.PlainGPT() if plain else tiny_llama(), _trainer("auto", 2)
    _fit(trainer, module)
    trainer.save_checkpoint(Path(out).with_suffix(".ckpt"), weights_only=False)
    torch.save(_full_state(module), out)


class Restored(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        state = _full_state(pl_module)
        state["global_step"] = trainer.global_step
        if trainer.global_rank == 0:
            torch.save(state, self.out)


def resume(out: str, source: str, layout: str | None = None, plain: bool = False) -> None:
    strategy = TitanStrategy(**({layout: 2} if layout else {}))
    trainer = _trainer(strategy, 3, [Restored(out)])
    module = plain_module.PlainGPT() if plain else tiny_llama()
    dp = trainer.world_size // (2 if layout == "tp" else 1)
    _fit(trainer, module, Path(source).with_suffix(".ckpt"), dp)
