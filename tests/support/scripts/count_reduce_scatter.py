"""Train 2 steps with the Python API and report how many gradient collectives FSDP issued.

Run as a script: Lightning's launcher re-runs it for the other ranks.
Usage: count_reduce_scatter.py DEVICES MICRO_BATCH OUT_JSON [GRAD_REDUCE_SCATTER [DP_REPLICATE]]

Writes (rank 0) the reduce-scatters and all-reduces issued from FSDP's own code, the step runner's
all-reduces of the valid-target count (``strategies/step.py``), the optimizer
steps, the accumulation and the number of FSDP parameter groups (one reduce-scatter each per
reduction), so a test can state the expected counts exactly.
"""

import json
import os
import sys

import lightning as L
import torch.distributed as dist

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule
from lit_titan.strategies.fsdp import fsdp_param_groups

GLOBAL_BATCH = 8


def main(argv: list[str] | None = None) -> None:
    """Also called on every rank of a running world (tests/support/world.py): the counting wrappers are removed
    on return."""
    argv = sys.argv[1:] if argv is None else argv
    devices, micro, out = int(argv[0]), int(argv[1]), argv[2]
    mode = argv[3] if len(argv) > 3 else "every_microbatch"
    replicate = int(argv[4]) if len(argv) > 4 else 1
    calls = {"reduce_scatters": 0, "all_reduces": 0, "step_count_all_reduces": 0}
    depth = {"n": 0}

    def counted(original, key):
        def counting(*args, **kwargs):  # the real collective, counted once even if it calls another
            caller = sys._getframe(1).f_code.co_filename
            outer = depth["n"] == 0  # the collective itself, not one it calls
            by = key if "fsdp" in caller else "step_count_all_reduces" if caller.endswith("step.py") else None
            depth["n"] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth["n"] -= 1
                if outer and by is not None:
                    calls[by] += 1

        return counting

    # FSDP2 calls reduce_scatter_tensor (torch 2.11) or reduce_scatter_single (2.14+); all_reduce under HSDP.
    originals = {
        name: getattr(dist, name)
        for name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_reduce")
        if hasattr(dist, name)
    }
    for name, original in originals.items():
        setattr(dist, name, counted(original, "all_reduces" if name == "all_reduce" else "reduce_scatters"))
    try:
        _fit(devices, micro, out, mode, replicate, calls)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _fit(devices: int, micro: int, out: str, mode: str, replicate: int, calls: dict) -> None:
    module = PretrainModule(
        "llama3_debug", {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}, {"total_steps": 2}
    )
    data = PretrainDataModule(
        seq_len=32,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=micro,
        max_bytes=300_000,
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        data_dir=os.environ["LIT_TITAN_CACHE"],
    )
    accumulation = GLOBAL_BATCH // (devices * micro)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        accumulate_grad_batches=accumulation,
        strategy=TitanStrategy(dp_replicate=replicate, grad_reduce_scatter=mode),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=data)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    **calls,
                    "steps": trainer.global_step,
                    "accumulation": accumulation,
                    "fsdp_groups": len(fsdp_param_groups([module.model])),
                },
                f,
            )


if __name__ == "__main__":
    main()
