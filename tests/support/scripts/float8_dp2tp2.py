"""Train a few steps through the Python API, optionally with Float8, and write rank 0's losses.

Usage: float8_dp2tp2.py OUT_JSON DEVICES [key=value ...]
  strategy kwargs (dp_shard=2 tp=2 ...), precision=bf16-mixed, accelerator=cpu, float8=0|1, compile=0|1,
  steps=N (the LR schedule's length), max_steps=M (stop after M <= N steps: same schedule, fewer steps),
  float8.<Float8 kwarg>=value (recipe, enable_fsdp_float8_all_gather, precompute_scales, emulate, float8_tp),
  model.<model arg>=value (e.g. model.parallel_block=true), optim.<OptimConfig field>=value (e.g. optim.lr=1e-2),
  clip=C (trainer gradient_clip_val), data.micro_batch_size=B with accumulate=N (per-rank batch / B),
  dump=DIR (tests/support/parity.py's ParityDump at parity.DUMP_STEPS into DIR).
Run as a script (Lightning's launcher re-runs it for the other ranks, hence the __main__ guard), or
call ``main(argv)`` on every rank of a running world (tests/support/world.py): the watches it installs are
removed again when it returns, so the next case in the same process starts clean.

With float8.float8_tp=true on CPU, gloo (which has no float8 collectives: "Invalid scalar type") is
sent the float8 TP all-gathers as their raw bytes (uint8 views, see ``_watch_float8_tp_all_gather``):
an all-gather only copies bytes, so this changes the transport dtype and nothing else.
"""

import contextlib
import json
import os
import sys

import lightning as L
import torch

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.callbacks import Compile
from lit_titan.callbacks.float8 import Float8
from lit_titan.data import PretrainDataModule

GATHERED_DTYPES: set[str] = set()
TP_FLOAT8_GATHERS = [0]  # float8 all-gathers of the TP styles (funcol on torchao's Float8TrainingTensor)


def _watch_float8_all_gather(stack: contextlib.ExitStack) -> None:
    """Record the dtypes FSDP all-gathers for torchao's float8 weights (proves the FP8 all-gather ran)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def watched(self, mesh):  # FSDP checks this exact signature
        out = original(self, mesh)
        GATHERED_DTYPES.update(str(t.dtype) for t in out[0])
        return out

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = watched
    stack.callback(setattr, WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", original)


def _watch_float8_tp_all_gather(as_bytes: bool, stack: contextlib.ExitStack) -> None:
    """Count the float8 all-gathers torchao's float8 TP styles issue; with ``as_bytes`` send them as uint8.

    FSDP's float8 all-gather does not pass here (FSDP gathers its own uint8 buffers), so the count is
    tensor parallelism's alone.
    """
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    for op in (
        torch.ops.c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
    ):
        original = FLOAT8_OPS_TABLE[op]

        def watched(aten_op, args, kwargs=None, original=original):
            TP_FLOAT8_GATHERS[0] += 1
            if not as_bytes:
                return original(aten_op, args, kwargs)
            t = args[0]
            data = aten_op(t._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
            return Float8TrainingTensor(
                data.view(t._data.dtype), t._scale, t._orig_dtype, t._linear_mm_config, t._gemm_input_role
            )

        FLOAT8_OPS_TABLE[op] = watched
        stack.callback(FLOAT8_OPS_TABLE.__setitem__, op, original)


class Record(L.Callback):
    def __init__(self, out: str) -> None:
        self.out, self.losses, self.scales_set = out, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # inside an accumulation window: the step's loss is logged at its last micro-batch
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        # Did the FSDP float8 all-gather weights get a precomputed scale (set by Float8 after the step)?
        w = [m.weight for m in pl_module.model.modules() if type(m).__name__ == "Float8Linear"]
        local = [getattr(x, "_local_tensor", x) for x in w]
        self.scales_set.append(sum(getattr(t, "_precomputed_scale", None) is not None for t in local))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        model = pl_module.model
        weight_types = sorted(
            {
                type(getattr(m.weight, "_local_tensor", m.weight)).__name__
                for m in model.modules()
                if type(m).__name__ == "Float8Linear"
            }
        )
        with open(self.out, "w") as f:
            json.dump(
                {
                    "losses": self.losses,
                    "scales_set": self.scales_set,
                    "weight_types": weight_types,
                    "all_gather_dtypes": sorted(GATHERED_DTYPES),
                    "tp_float8_all_gathers": TP_FLOAT8_GATHERS[0],
                    "float8_modules": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
                    "ffn_norms": sum(name.endswith("ffn_norm") for name, _ in model.named_modules()),
                },
                f,
            )


def _parse(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value) if value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out, devices = argv[0], int(argv[1])
    strategy_kwargs, float8_kwargs, model_kwargs = {}, {"emulate": True, "auto_filter_small_kn": False}, {}
    optim_kwargs: dict = {}
    precision, accelerator, steps, max_steps, use_float8, use_compile = "bf16-mixed", "cpu", 20, None, True, False
    trainer_kwargs: dict = {}
    data_kwargs: dict = {}
    callbacks: list = []
    for item in argv[2:]:
        key, value = item.split("=", 1)
        if key == "precision":
            precision = value
        elif key == "accelerator":
            accelerator = value
        elif key == "steps":
            steps = int(value)
        elif key == "max_steps":
            max_steps = int(value)
        elif key == "compile":
            use_compile = bool(int(value))
        elif key == "float8":
            use_float8 = bool(int(value))
        elif key.startswith("data."):
            data_kwargs[key.removeprefix("data.")] = _parse(value)
        elif key == "accumulate":
            trainer_kwargs["accumulate_grad_batches"] = int(value)
        elif key == "clip":
            trainer_kwargs["gradient_clip_val"] = float(value)
        elif key == "dump":
            from parity import DUMP_STEPS, ParityDump  # tests/ is on the path in a world's ranks

            callbacks.append(ParityDump(value, DUMP_STEPS))
        elif key.startswith("optim."):
            optim_kwargs[key.removeprefix("optim.")] = float(value)
        elif key.startswith("model."):
            model_kwargs[key.removeprefix("model.")] = _parse(value)
        elif key.startswith("float8."):
            float8_kwargs[key.removeprefix("float8.")] = _parse(value)
        else:
            strategy_kwargs[key] = _parse(value)
    GATHERED_DTYPES.clear()
    TP_FLOAT8_GATHERS[0] = 0
    with contextlib.ExitStack() as stack:
        _watch_float8_all_gather(stack)
        _watch_float8_tp_all_gather(accelerator == "cpu", stack)
        _train(
            out,
            devices,
            strategy_kwargs,
            float8_kwargs,
            precision,
            accelerator,
            steps,
            max_steps,
            use_float8,
            use_compile,
            model_kwargs,
            optim_kwargs,
            trainer_kwargs,
            data_kwargs,
            callbacks,
        )


def _train(
    out,
    devices,
    strategy_kwargs,
    float8_kwargs,
    precision,
    accelerator,
    steps,
    max_steps,
    use_float8,
    use_compile,
    model_kwargs,
    optim_kwargs,
    trainer_kwargs,
    data_kwargs,
    extra_callbacks,
) -> None:
    torch.manual_seed(0)
    module = PretrainModule(
        "llama3_debug",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, **model_kwargs},
        {"total_steps": steps, "warmup_steps": 2, **optim_kwargs},
    )
    data = PretrainDataModule(
        seq_len=32,
        global_batch_size=8,
        max_bytes=300_000,
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        data_dir=os.environ["LIT_TITAN_CACHE"],
        **data_kwargs,
    )
    callbacks = [Record(out)] + ([Float8(**float8_kwargs)] if use_float8 else []) + ([Compile()] if use_compile else [])
    callbacks += extra_callbacks
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=TitanStrategy(**strategy_kwargs),
        precision=precision,
        max_steps=max_steps or steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        log_every_n_steps=1,
        **trainer_kwargs,
    )  # Record reads train/loss every step
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
