"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), correct on sharded parameters.

Why hand-written: torch has no LAMB, and the ones elsewhere (apex, timm, torch-optimizer) compute
the trust ratio ``||w|| / ||update||`` from whatever tensor they are given. Under FSDP, TP (and
FSDP x TP) a parameter is a DTensor whose local piece is a shard, so a per-shard norm gives every
rank a different, wrong ratio and trains silently wrong. Here the squared norms of every local
piece are taken with one ``torch._foreach_norm`` per group, then summed over exactly the mesh dims a
parameter is sharded on (one all-reduce per distinct (mesh, sharded dims) and mesh dim, all the
parameters of that kind stacked into one tensor): no per-parameter collective and no
per-parameter Python arithmetic on the hot path. Pipeline stages hold whole parameters, so PP
needs no reduction (the trust ratio is per parameter).

The update, per parameter ``w`` with gradient ``g`` at step ``t``::

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    w -= lr * (||w|| / ||u||) * u      (ratio 1 when either norm is 0)

with one ratio per matrix of a stacked parameter (``matrix_norms``: an MoE layer's experts).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def check_betas(betas: Iterable[float]) -> tuple[float, float]:
    """The two betas, each in [0, 1), or ValueError naming ``optim.betas``."""
    b = tuple(float(x) for x in betas)
    if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
        raise ValueError(f"optim.betas={list(b)} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.999]")
    return b  # type: ignore[return-value]


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _like_param(grad: Tensor, p: Tensor) -> Tensor:
    """The gradient in its parameter's layout (e.g. TP's head: a replicated gradient of a sharded weight).

    torch's optimizers get this from DTensor's dispatch; this one works on local pieces, so it asks.
    """
    spec, gspec = getattr(p, "_spec", None), getattr(grad, "_spec", None)
    if spec is None or gspec is None or gspec.placements == spec.placements:
        return grad
    return grad.redistribute(spec.mesh, spec.placements)


def _sharded_dims(p: Tensor) -> tuple[Any, tuple[int, ...]]:
    """(mesh, mesh dims the parameter is split over) of a DTensor; (None, ()) for a plain tensor."""
    spec = getattr(p, "_spec", None)
    if spec is None:
        return None, ()
    # not ``is_shard()``: FSDP x TP's _StridedShard is no Shard (torch 2.15), and its dim is split too
    return spec.mesh, tuple(i for i, pl in enumerate(spec.placements) if not (pl.is_replicate() or pl.is_partial()))


def full_norms(tensors: list[Tensor], like: list[Tensor]) -> Tensor:
    """L2 norm of each whole tensor (all shards), as one 1-D tensor; ``like[i]`` says how ``tensors[i]`` is split.

    ``tensors`` are local pieces; the squared norms of those split the same way are stacked and
    all-reduced (sum) over each mesh dim they are sharded on, once per kind, not per parameter.
    """
    dtype = torch.promote_types(tensors[0].dtype, torch.float32) if tensors else torch.float32  # fp64 for fp64
    sq = torch.stack(torch._foreach_norm(tensors, dtype=dtype)).square() if tensors else torch.zeros(0)
    kinds: dict[tuple[Any, tuple[int, ...]], list[int]] = defaultdict(list)
    for i, p in enumerate(like):
        mesh, dims = _sharded_dims(p)
        if dims:
            kinds[(mesh, dims)].append(i)
    for (mesh, dims), idx in kinds.items():
        index = torch.tensor(idx, device=sq.device)
        part = sq.index_select(0, index)
        for d in dims:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        sq = sq.index_copy(0, index, part)
    return sq.sqrt()


def _trust_ratio(w_norm: Tensor, u_norm: Tensor) -> Tensor:
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))


def matrix_norms(t: Tensor, like: Tensor) -> Tensor:
    """L2 norm of each matrix of a stack (``t``'s last two dims; a local piece split like ``like``), whole.

    A parameter of more than two dims is a stack of matrices over its leading dims (an MoE layer's experts,
    ``[experts, out, in]``): each is a layer's weight to the paper, as it is in a model with one Linear per
    expert, so each gets its own trust ratio. Its pieces are split over the experts (whole matrices per rank);
    a split of the matrices themselves is summed over the mesh dims that make it."""
    sq = t.to(torch.promote_types(t.dtype, torch.float32)).square().sum(dim=(-2, -1))
    spec = getattr(like, "_spec", None)
    if spec is not None:
        for d, placement in enumerate(spec.placements):
            if getattr(placement, "dim", -1) >= t.dim() - 2 and not placement.is_replicate():
                dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=spec.mesh.get_group(d))
    return sq.sqrt()


class Lamb(torch.optim.Optimizer):
    """LAMB with bias correction and decoupled weight decay inside the trust-ratio update (foreach)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        from lit_titan.optim.low_precision import StateRounding

        betas = check_betas(betas)
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"LAMB needs lr, eps, weight_decay >= 0 (got {lr}, {eps}, {weight_decay})")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype  # of the moments (None: the parameter's); bf16: stochastic rounding
        self._rounding = StateRounding()

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:  # state creation, first step only
                if not self.state[p]:
                    self.state[p].update(
                        step=torch.zeros((), dtype=torch.float32),
                        exp_avg=torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format),
                    )
            self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        b1, b2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        w = [_local(p) for p in params]
        g = [_local(_like_param(p.grad, p)) for p in params]
        m_store = [_local(s["exp_avg"]) for s in states]
        v_store = [_local(s["exp_avg_sq"]) for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        t = float(steps[0])  # every parameter of a group steps together
        low = m_store[0].dtype != g[0].dtype  # bf16 moments: the arithmetic on fp32 copies, stored rounded
        m, v = ([x.to(g[0].dtype) for x in xs] for xs in (m_store, v_store)) if low else (m_store, v_store)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        if low:
            self._rounding.start_step(int(t))
            salts = [0] * len(params) + [1] * len(params)
            for stored, value, p, salt in zip([*m_store, *v_store], [*m, *v], [*params, *params], salts):
                self._rounding.store_(stored, value, p, salt)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2**0.5)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(m, denom)
        torch._foreach_div_(update, bc1)
        if wd != 0:
            torch._foreach_add_(update, w, alpha=wd)
        flat = [i for i, p in enumerate(params) if p.dim() <= 2]
        if flat:
            w_norm = full_norms([w[i] for i in flat], [params[i] for i in flat])
            u_norm = full_norms([update[i] for i in flat], [params[i] for i in flat])
            scale = _trust_ratio(w_norm, u_norm) * -lr
            torch._foreach_mul_([update[i] for i in flat], list(scale.to(update[flat[0]].dtype).unbind(0)))
        for i in (i for i, p in enumerate(params) if p.dim() > 2):  # stacked matrices: one ratio per matrix
            scale = _trust_ratio(matrix_norms(w[i], params[i]), matrix_norms(update[i], params[i])) * -lr
            update[i].mul_(scale.to(update[i].dtype)[..., None, None])
        torch._foreach_add_(w, update)


__all__ = ["Lamb", "check_betas", "full_norms"]
