"""Train 2 steps with the Python API and report how many reduce-scatters FSDP issued per step.

Run as a script: Lightning's launcher re-runs it for the other ranks.
Usage: count_reduce_scatter.py DEVICES MICRO_BATCH OUT_JSON
"""

import json
import os
import sys

import lightning as L
import torch.distributed as dist

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule


def main() -> None:
    devices, micro, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    calls = {"n": 0}

    def counted(original):
        def counting(*args, **kwargs):  # the real collective, counted
            calls["n"] += 1
            return original(*args, **kwargs)

        return counting

    # FSDP2 calls reduce_scatter_tensor (torch 2.11) or reduce_scatter_single (2.14).
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name)))
    module = PretrainModule("llama3_debug", {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                             "vocab_size": 512}, {"total_steps": 2})
    data = PretrainDataModule(seq_len=32, global_batch_size=8, micro_batch_size=micro, max_bytes=300_000,
                              tokenizer={"kind": "bpe", "vocab_size": 512}, model_vocab_size=512,
                              data_dir=os.environ["LIT_TITAN_CACHE"])
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=TitanStrategy(), max_steps=2,
                        accumulate_grad_batches=8 // (devices * micro), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, datamodule=data)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"reduce_scatters": calls["n"], "steps": trainer.global_step}, f)


if __name__ == "__main__":
    main()
