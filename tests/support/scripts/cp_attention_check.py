"""Run in a reused world (every rank one cp rank of the world group): each CP attention mode against plain
attention of the whole sequence on one rank, forward and backward, on random Q/K/V.

Returns, per case "mode window docs", the largest error of the local output and of the gradients of the
local Q, K and V, relative to the largest reference value. fp64, so the errors are rounding only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_titan.models.llama3.attention import attention, attention_mask
from lit_titan.strategies.context_parallel import ContextParallel
from lit_titan.strategies.cp_chunks import ShardedDocuments


def _documents(b: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Document ids with boundaries inside chunks and on chunk edges."""
    starts = torch.rand(b, seq, generator=gen) < 0.15
    starts[:, 0] = False
    starts[0, seq // 2] = True  # a boundary exactly at a chunk edge of every cp
    return starts.long().cumsum(1)


def _shard(engine: ContextParallel, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a [b, heads, seq, d] tensor."""
    return engine.shard(t.transpose(1, 2))[0].transpose(1, 2)


def main(argv: list[str]) -> dict[str, float]:
    group = dist.group.WORLD
    cp = dist.get_world_size()
    b, heads, kv_heads, seq, d = 2, 2 * cp, cp, 16 * cp, 8  # GQA; ulysses: heads divisible by cp
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, seq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, seq, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv_heads, seq, d, generator=gen, dtype=torch.float64)
    g = torch.randn(b, heads, seq, d, generator=gen, dtype=torch.float64)
    docs = _documents(b, seq, gen)
    errors: dict[str, float] = {}
    for mode in argv or ["allgather", "ulysses", "ring"]:
        engine = ContextParallel(group, mode)
        for window in (None, 5, 20):
            for with_docs in (False, True):
                ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
                mask = attention_mask("sdpa", docs if with_docs else None, seq, q.device, window=window)
                ref = attention(*ref_in, mask)
                ref.backward(g)
                # this rank's slice, through the mode's core
                local = [_shard(engine, t).detach().clone().requires_grad_() for t in (q, k, v)]
                core = engine.core(window, {})
                local_mask = ShardedDocuments(engine.shard(docs)[0], group) if with_docs else None
                out = core(*local) if local_mask is None else core(*local, local_mask)
                out.backward(_shard(engine, g))
                scale = ref.abs().max().item()
                err = (out - _shard(engine, ref)).abs().max().item() / scale
                for got, want in zip(local, ref_in):
                    err = max(
                        err, (got.grad - _shard(engine, want.grad)).abs().max().item() / want.grad.abs().max().item()
                    )
                errors[f"{mode} window={window} docs={with_docs}"] = err
    return errors
