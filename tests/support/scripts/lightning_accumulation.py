"""The Python API with Lightning's own knob: ``Trainer(accumulate_grad_batches=N)`` under ``TitanStrategy``.

``main(out, accumulate, micro)`` trains 2 steps of the tiny Llama with ``PretrainDataModule(micro_batch_size=micro)``
and ``Trainer(accumulate_grad_batches=accumulate)`` in one process, and saves step 0's pre-clip gradients and the
number of micro-batches the step runner trained per step (tests/unit/strategies/test_step.py compares the knobs).
"""

from __future__ import annotations

import os

import lightning as L
import torch

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule


class _Grads(L.Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def main(out: str, accumulate: int, micro: int | None) -> None:
    module = PretrainModule(
        "llama3_debug", {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}, {"total_steps": 2}
    )
    data = PretrainDataModule(
        seq_len=32,
        global_batch_size=8,
        micro_batch_size=micro,
        max_bytes=300_000,
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        data_dir=os.environ["LIT_TITAN_CACHE"],
    )
    probe = _Grads()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        accumulate_grad_batches=accumulate,
        strategy=TitanStrategy(),
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[probe],
    )
    trainer.fit(module, datamodule=data)
    torch.save(
        {"grads": probe.grads, "micro_batches": module._micro_batches_per_batch, "steps": trainer.global_step}, out
    )
