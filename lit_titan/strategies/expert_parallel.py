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

With tensor parallel (``tp_mesh``; TorchTitan's layout with expert TP off): the MoE layer's input is
gathered over tp (``models/qwen3_moe/parallelize.py``), so every tp rank routes the same tokens and holds
the same balancing statistics. The routed experts are split over ep x tp (``expert_mesh`` is that
flattened mesh), and each tp rank dispatches its 1/tp share of the (token, routing weight) assignments,
sorted by expert, over it: no expert is computed twice. The share is a ``Shard(0)`` of replicated
assignments, whose backward all-gathers the shares' gradients, so every tp rank's router gets every
token's gradient; taken as a plain slice, the router's gradient would be partial over tp, never reduced.
The weighted outputs are all-gathered back (their gradient is replicated: a slice in backward). An
expert shard's gradient still sums each assignment once (it lives on one rank), so the divide factor
stays dp x cp.
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


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
    """Shard every MoE layer's experts of ``model`` (meta or real) over the 1-D ``expert_mesh``; dispatch by
    all-to-all over it. ``tp_mesh``: the tensor-parallel mesh when tp > 1 (``expert_mesh`` is then ep x tp)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    shards = expert_mesh.size()
    for moe in moe_layers(model):
        num = moe.args.num_experts
        if num % shards:
            raise ValueError(f"parallel.ep x tp={shards} must divide the model's {num} experts")
        for name in ("w1", "w2", "w3"):
            full = getattr(moe.experts, name).detach()
            full = full.to_local() if hasattr(full, "to_local") else full  # TP made it Replicate over tp
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(full, expert_mesh, [Shard(0)])))
        moe.ep_group = expert_mesh.get_group()
        moe.tp_mesh = tp_mesh
        moe.run_experts = _dispatch_combine.__get__(moe)


def split_over_tp(t: Tensor, tp_mesh: DeviceMesh) -> Tensor:
    """This tp rank's rows of ``t`` (the same on every tp rank; ``torch.chunk``'s split, so uneven counts
    work); backward all-gathers the rows' gradients."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(0)]).to_local()


def gather_over_tp(t: Tensor, tp_mesh: DeviceMesh, rows: int) -> Tensor:
    """Every tp rank's rows (``split_over_tp``'s shares of ``rows``), concatenated in rank order; backward keeps
    this rank's rows of the (replicated) gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = (rows, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    local = DTensor.from_local(t, tp_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return local.redistribute(placements=[Replicate()]).to_local()


def _dispatch_combine(self: MoE, x: Tensor, counts: Tensor, weights: Tensor) -> Tensor:
    """x: this rank's tokens sorted by (global) expert, ``counts`` [E], ``weights`` [n, 1] -> their weighted
    outputs, same order. Under tp, this tp rank takes its share of the rows (the module docstring says why)."""
    tp_mesh = self.tp_mesh
    rows = x.shape[0]
    if tp_mesh is not None:
        # this rank's rows, as torch.chunk (and so Shard(0)) splits them: ceil(rows / tp) per rank, the last short
        size = -(-rows // tp_mesh.size())
        start = min(rows, tp_mesh.get_local_rank() * size)
        expert_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        counts = torch.bincount(expert_ids[start : start + size], minlength=counts.numel())
        x, weights = split_over_tp(x, tp_mesh), split_over_tp(weights, tp_mesh)
    out = _all_to_all_experts(self, x, counts)
    out = out * weights.to(out.dtype)
    return out if tp_mesh is None else gather_over_tp(out, tp_mesh, rows)


def _all_to_all_experts(self: MoE, x: Tensor, counts: Tensor) -> Tensor:
    """x sorted by (global) expert, ``counts`` [E] -> the experts' outputs, same order (over ``ep_group``)."""
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
