"""Expert parallel: each rank of an ``ep`` group holds num_experts / ep experts; tokens travel by all-to-all.

``parallel.ep=N`` (TitanStrategy, after TP/CP and before activation checkpointing, compile and FSDP):
``apply_expert_parallel`` makes every MoE layer's expert weights DTensors sharded over the ``ep`` mesh
(dim 0: this rank keeps num_experts / ep experts, the checkpoint sees the full [E, ...] weights, so DCP
reshards to another ``ep``) and routes
its tokens through dispatch (all-to-all of tokens sorted by expert, to the rank holding the
expert) and combine (the reverse all-to-all), both differentiable
(``all_to_all_single_autograd``), so the backward sends gradients the same way back; gloo on CPU,
NCCL on GPU.

Gradient divide factors follow from the layout: every rank's loss is the mean over its own tokens
and the step's gradient is the mean over the dp x cp ranks, so a dense gradient is summed over
those ranks and divided by their number; an expert shard's gradient already holds the
contributions of the tokens of all ``ep`` ranks (the all-to-all's backward brought them), so it is
summed over the ranks holding the same shard (the expert-data-parallel group) and divided by the
*same* dp x cp number, not by the size of that group (which would make it ``ep`` times too large).
Under FSDP that is ``strategies/fsdp.py``'s ``apply_expert_fsdp`` (its divide factor); without FSDP,
``reduce_gradients``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from lit_titan.models.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts of ``model`` (meta or real) over the 1-D ``ep_mesh``; dispatch by all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    for moe in moe_layers(model):
        num = moe.args.num_experts
        if num % ep:
            raise ValueError(f"parallel.ep={ep} must divide the model's {num} experts")
        for name in ("w1", "w2", "w3"):
            full = getattr(moe.experts, name)
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)])))
        moe.ep_group = ep_mesh.get_group()
        moe.run_experts = _dispatch_combine.__get__(moe)


def _dispatch_combine(self: MoE, x: Tensor, counts: Tensor) -> Tensor:
    """x: this rank's tokens sorted by (global) expert, ``counts`` [E] -> their outputs, same order."""
    group = self.ep_group
    ep = dist.get_world_size(group)
    local = self.args.num_experts // ep
    # how many tokens every rank sends to each of my experts: [source rank, my expert]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, local)
    send = counts.view(ep, local).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    tokens = all_to_all_single_autograd(x, recv, send, group)
    # arrived grouped by source rank, then expert: regroup by expert (source order kept within one)
    expert_of = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv_counts.flatten())
    perm = torch.argsort(expert_of, stable=True)
    out = self.experts(tokens[perm], recv_counts.sum(0))
    out = out[torch.argsort(perm)]
    return all_to_all_single_autograd(out, send, recv, group)


@torch.no_grad()
def reduce_gradients(model: nn.Module, dp_group: dist.ProcessGroup, edp_group: dist.ProcessGroup | None) -> None:
    """Average gradients over the dp x cp ranks without FSDP (a replicated model, the reference path).

    Dense: sum over ``dp_group`` / its size. Experts (sharded by EP): sum over ``edp_group`` (the
    ranks holding the same experts; None: none) / the size of ``dp_group``. FSDP does the same with
    its divide factor set to the dp x cp size once the strategy wires EP in.
    """
    dp = dist.get_world_size(dp_group)
    experts = {id(p) for m in moe_layers(model) if hasattr(m, "ep_group") for p in m.experts.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if id(p) in experts:
            if edp_group is not None:
                dist.all_reduce(grad, group=edp_group)
        else:
            dist.all_reduce(grad, group=dp_group)
        grad.div_(dp)
