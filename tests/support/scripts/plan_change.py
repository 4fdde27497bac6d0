"""Swap the Llama plan's embedding TP style, then plan or train with it.

The embedding becomes ColwiseParallel (shard the embedding dim, weight placement S(1) on tp)
instead of TorchTitan's RowwiseParallel (shard the vocabulary, S(0)); both are correct layouts.
The changed plan is the llama3 family's (its entry in ``models/registry.py``'s ``FAMILIES``, where the
strategy and the planner look a plan up) only while ``main`` runs, and the stock entry is put back on return:
``main`` runs in the test's own process (plan) and on every rank of a reused world
(tests/support/world.py, train), where module state outlives the case.
Usage: plan_change.py {plan|train} OUT_JSON [hydra overrides]
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import replace

import lightning as L

from lit_titan.models import registry
from lit_titan.models.llama3.parallelize import LLAMA3_PLAN


def tp_root_colwise_embedding(model, loss_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    plan = LLAMA3_PLAN.tp_root(model, loss_parallel)
    if "tok_embeddings" in plan:
        plan["tok_embeddings"] = ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    return plan


@contextlib.contextmanager
def colwise_embedding() -> Iterator[None]:
    """The llama3 family with the changed plan; the family's stock entry restored on exit."""
    stock = registry.FAMILIES["llama3"]
    changed = replace(registry.family("llama3"), plan=replace(LLAMA3_PLAN, tp_root=tp_root_colwise_embedding))
    registry.FAMILIES["llama3"] = lambda: changed
    try:
        yield
    finally:
        registry.FAMILIES["llama3"] = stock


class DumpPlacements(L.Callback):
    """What training actually built: every parameter's placements and local shape, rank 0."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            params = {
                n: {
                    "placements": [str(p) for p in getattr(t, "placements", ())],
                    "local_shape": list(t.to_local().shape) if hasattr(t, "to_local") else list(t.shape),
                }
                for n, t in pl_module.model.named_parameters()
            }
            with open(self.out, "w") as f:
                json.dump(params, f)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    mode, out, overrides = argv[0], argv[1], argv[2:]
    with colwise_embedding():
        if mode == "plan":
            from lit_titan.cli.plan import make_plan

            with open(out, "w") as f:
                json.dump(make_plan(overrides, write=False)["per_rank"]["example_parameters"], f)
        else:
            from lit_titan.config import compose
            from lit_titan.job.run import train

            train(compose(overrides), callbacks=[DumpPlacements(out)])


if __name__ == "__main__":
    main()
