"""Swap the Llama plan's embedding TP style, then plan or train with it.

The embedding becomes ColwiseParallel (shard the embedding dim, weight placement S(1) on tp)
instead of TorchTitan's RowwiseParallel (shard the vocabulary, S(0)); both are correct layouts.
Registered at import, so Lightning's launcher (which re-runs this script per rank) sees it too.
Usage: plan_change.py {plan|train} OUT_JSON [hydra overrides]
"""

import json
import sys
from dataclasses import replace

import lightning as L

from lit_titan.models.llama3 import Transformer
from lit_titan.models.llama3.plan import LLAMA3_PLAN
from lit_titan.strategies.plan import register_plan


def tp_root_colwise_embedding(model, loss_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    plan = LLAMA3_PLAN.tp_root(model, loss_parallel)
    if "tok_embeddings" in plan:
        plan["tok_embeddings"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                 use_local_output=False)
    return plan


register_plan(Transformer, replace(LLAMA3_PLAN, tp_root=tp_root_colwise_embedding))


class DumpPlacements(L.Callback):
    """What training actually built: every parameter's placements and local shape, rank 0."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            params = {n: {"placements": [str(p) for p in getattr(t, "placements", ())],
                          "local_shape": list(t.to_local().shape) if hasattr(t, "to_local") else list(t.shape)}
                      for n, t in pl_module.model.named_parameters()}
            with open(self.out, "w") as f:
                json.dump(params, f)


def main() -> None:
    mode, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "plan":
        from lit_titan.plan import make_plan

        with open(out, "w") as f:
            json.dump(make_plan(overrides, write=False)["per_rank"]["example_parameters"], f)
    else:
        from lit_titan.config import compose
        from lit_titan.train import train

        train(compose(overrides), callbacks=[DumpPlacements(out)])


if __name__ == "__main__":
    main()
