"""Routing ties on every rank of a gloo world: data parallel equals one process when every score ties.

The router's weights are zeroed, so every token's scores are equal (1/E each) and top-k's tie-breaking
alone picks the experts; each rank takes its rows of the batch, gradients are averaged over the world,
and rank 0 compares them with one process on the whole batch (fp64). Rank 0's own reference is unaffected
by a rank-dependent tie mutant (tests/support/mutants/), which changes the other ranks' choices only.
"""

from __future__ import annotations

import torch

from moe_cases import BATCH, build, make_batch, rel_err, tiny_args


def dp_ties_error(mutant: str | None = None) -> float:
    import torch.distributed as dist

    from mutants import applied

    rank, world = dist.get_rank(), dist.get_world_size()
    args = tiny_args(aux_loss="sequence", aux_loss_coef=0.01)
    reference, ours = build(args), build(args)
    for model in (reference, ours):
        for m in model.moe_layers():
            torch.nn.init.zeros_(m.router.gate.weight)
    tokens, labels = make_batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    with applied(mutant):
        reference(tokens, labels=labels).backward()
        ours(tokens[rows], labels=labels[rows]).backward()
    worst = 0.0
    for p, ref in zip(ours.parameters(), reference.parameters()):
        dist.all_reduce(p.grad)
        worst = max(worst, rel_err(p.grad / world, ref.grad))
    result = torch.tensor([worst], dtype=torch.float64)
    dist.broadcast(result, src=0)
    return result.item()
