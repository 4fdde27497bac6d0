"""Count host reads and non-model collectives per optimizer step of a real ``lit_titan.train`` run.

Counting wrappers call through to the real functions (nothing is mocked):
- host reads: ``Tensor.item``, ``Tensor.cpu``, ``Tensor.tolist``, ``Tensor.numpy``, ``torch.cuda.synchronize``
  (on a GPU each is a device-to-host wait), except those from ``HOST_SIDE`` code, whose tensors
  live on the CPU whatever the accelerator;
- collectives: every ``torch.distributed`` collective, except those issued from the model's own
  parallelism (FSDP, DTensor/TP, pipelining, the grad-norm reduction that clipping needs; the same
  files' host reads are theirs too) and the preemption agreement (a CPU tensor on gloo, no host sync);
- ``LightningModule.log`` calls: each logs a value, and a Python number becomes a blocking
  host-to-device copy on a GPU.
Each event is charged to the optimizer step (1-based) whose batch Lightning's training loop is running.

Usage as a script (Lightning's launcher re-runs it for the other ranks):
    count_host_syncs.py OUT_DIR [hydra overrides of lit_titan.train]
writes OUT_DIR/counts-rank<R>.json. Imported, :class:`SyncCounter` does the same in-process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

HOST_READS = ("item", "cpu", "tolist", "numpy")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "batch_isend_irecv",
)  # not isend/irecv: torch checks P2POp's op by identity (pipelining only)
# Collectives and host reads called directly from these files belong to the model's parallel execution,
# not to bookkeeping.
MODEL_OWN = (
    "torch/distributed/fsdp/",
    "torch/distributed/tensor/",
    "torch/distributed/pipelining/",
    "torch/distributed/_composable/",
    "lit_titan/strategies/grad_norm.py",
    "lit_titan/strategies/context_parallel.py",
    # the step's loss normaliser: one all-reduce of a device scalar (the valid-target count) per step, which the
    # loss needs as FSDP needs its reductions (TorchTitan's global valid tokens); no host read
    "lit_titan/strategies/step.py",
)
# Reads of tensors that stay on the host on every device: torch's optimizers keep their step
# counters on the CPU (unless capturable or fused, which read none), the DataLoader draws its seed
# from a CPU generator. Reads from anywhere else would wait for the GPU.
HOST_SIDE = ("torch/optim/", "torch/utils/data/")
# Collectives of CPU tensors on a gloo group, once per optimizer step by design: no device work and no
# host sync on any accelerator (the preemption agreement: docs/fault_tolerance.md "Preemption").
HOST_ONLY_COLLECTIVES = ("lit_titan/callbacks/preemption.py",)
C10D = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py")
_SELF = os.path.abspath(__file__)


def _caller(stack: list) -> str:
    """The innermost frame outside this file and torch: who asked for it."""
    for frame in reversed(stack):
        if os.path.abspath(frame.filename) != _SELF and "/torch/" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


class SyncCounter(L.Callback):
    def __init__(self) -> None:
        self.step = 0  # the optimizer step (1-based) of the batch being run; 0: outside training batches
        self.counts: dict[int, dict[str, int]] = defaultdict(lambda: {"host_reads": 0, "collectives": 0, "logs": 0})
        self.callers: dict[int, Counter] = defaultdict(Counter)
        self._undo: list[tuple[Any, str, Any]] = []

    # ---- counting wrappers ----------------------------------------------------------------------
    def _count(self, kind: str, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        direct = stack[-1].filename.replace(os.sep, "/")  # the code that called the counted function
        # ... or, inside torch.distributed's own helpers (e.g. recv_object_list), the code that called them
        owner = next(
            (
                f.filename.replace(os.sep, "/")
                for f in reversed(stack)
                if not f.filename.replace(os.sep, "/").endswith(C10D)
            ),
            direct,
        )
        if kind != "logs" and any(own in owner for own in MODEL_OWN):
            return  # e.g. torch's pipeline stages exchange their shapes on the first step
        if kind == "host_reads" and any(ok in direct for ok in HOST_SIDE):
            return
        if kind == "collectives" and any(ok in direct for ok in HOST_ONLY_COLLECTIVES):
            return
        self.counts[self.step][kind] += 1
        if self.step:
            via = "/".join(Path(direct).parts[-2:])
            self.callers[self.step][f"{kind}: {what} from {_caller(stack)} (called in {via}:{stack[-1].lineno})"] += 1

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self._count(kind, name)
            return original(*args, **kwargs)

        self._undo.append((owner, name, original))
        setattr(owner, name, counting)

    def install(self) -> SyncCounter:
        for name in HOST_READS:
            self._wrap(torch.Tensor, name, "host_reads")
        self._wrap(torch.cuda, "synchronize", "host_reads")
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, "collectives")
        self._wrap(L.LightningModule, "log", "logs")
        return self

    def uninstall(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)

    # ---- step attribution -----------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop
        advance = loop.advance

        def counted_advance(*args: Any, **kwargs: Any) -> Any:
            self.step = loop._batches_that_stepped + 1  # everything this batch does, logging included
            self.counts[self.step]["batches"] = self.counts[self.step].get("batches", 0) + 1
            return advance(*args, **kwargs)

        loop.advance = counted_advance

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = 0

    def report(self) -> dict[str, Any]:
        return {
            "steps": {str(k): v for k, v in sorted(self.counts.items()) if k},
            "callers": {str(k): dict(v) for k, v in sorted(self.callers.items())},
        }


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    from lit_titan.config import compose
    from lit_titan.job.run import train

    counter = SyncCounter().install()
    train(compose(overrides), callbacks=[counter])
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))
    (out / f"counts-rank{rank}.json").write_text(json.dumps(counter.report(), indent=1))


if __name__ == "__main__":
    main()
