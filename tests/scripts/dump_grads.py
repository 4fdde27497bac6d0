"""Train one step through the Python API and save every rank's full gradients.

Usage: dump_grads.py OUT_DIR DEVICES [strategy kwargs as key=value ...]
Run as a script (Lightning's launcher re-runs it for the other ranks), or call ``main(argv)`` on
every rank of a running world (tests/world.py).
"""

import os
import sys

import lightning as L
import torch

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule


class DumpGrads(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 0:
            return
        grads = {}
        for name, p in pl_module.model.named_parameters():
            if p.grad is not None:
                g = p.grad
                grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu()
        torch.save(grads, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, devices = argv[0], int(argv[1])
    kwargs, model = {}, {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
    for item in argv[2:]:  # strategy kwargs, or model.<arg>=N
        key, value = item.split("=", 1)
        parsed = int(value) if value.lstrip("-").isdigit() else value
        if key.startswith("model."):
            model[key.removeprefix("model.")] = parsed
        else:
            kwargs[key] = parsed
    module = PretrainModule("llama3_debug", model, {"total_steps": 1})
    data = PretrainDataModule(seq_len=32, global_batch_size=8, max_bytes=300_000,
                              tokenizer={"kind": "bpe", "vocab_size": 512}, model_vocab_size=512,
                              data_dir=os.environ["LIT_TITAN_CACHE"])
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=TitanStrategy(**kwargs), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False,
                        callbacks=[DumpGrads(out_dir)])
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
