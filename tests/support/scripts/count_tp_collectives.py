"""Collectives of one transformer block under TP (+ sequence parallel), sequential vs ``parallel_block``.

Called on every rank of a running world (tests/support/world.py), TP degree = world size. For each block
form it applies the model's real TP plan (``apply_tensor_parallel`` with the Llama plan), runs one
block's forward and backward under torch's ``CommDebugMode`` and returns the collective counts by
kind, plus the largest difference between the TP block's output and the same block on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def main(_: Any = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from lit_titan.models.llama3 import Transformer, get_flavor
    from lit_titan.models.llama3.parallelize import LLAMA3_PLAN
    from lit_titan.strategies.tensor_parallel import apply_tensor_parallel

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for parallel in (False, True):
        args = get_flavor(
            "llama3_debug", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, parallel_block=parallel
        )
        torch.manual_seed(0)
        ref = Transformer(args)
        ref.init_weights(seed=0)
        model = Transformer(args)
        model.init_weights(seed=0)
        apply_tensor_parallel(model, mesh, LLAMA3_PLAN, loss_parallel=False)
        x = torch.randn(2, 16, args.dim, generator=torch.Generator().manual_seed(1))
        cos, sin = ref.rope_cos[:16], ref.rope_sin[:16]
        want = ref.layers["0"](x, cos, sin)
        # the block's input as TP leaves it between blocks: the residual stream, Shard(1) over tp
        xs = DTensor.from_local(x.chunk(world, dim=1)[dist.get_rank()].clone().requires_grad_(), mesh, (Shard(1),))
        with CommDebugMode() as forward:
            got = model.layers["0"](xs, cos, sin)
        with CommDebugMode() as backward:
            got.to_local().square().sum().backward()
        name = "parallel" if parallel else "sequential"
        out[name] = {
            "forward": {str(k).split(".")[-1]: v for k, v in forward.get_comm_counts().items()},
            "backward": {str(k).split(".")[-1]: v for k, v in backward.get_comm_counts().items()},
            "max_diff": (got.full_tensor() - want).abs().max().item(),
        }
    return out
