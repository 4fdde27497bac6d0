"""Global gradient norm and clipping across every mesh dim (FSDP, TP, PP)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def total_grad_norm(
    params: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None, norm_type: float = 2.0
) -> Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank.

    Sharded (DTensor) gradients reduce over their own mesh through ``full_tensor``, one norm per
    mesh (expert parallel puts the experts on a mesh of their own, and DTensor ops do not cross
    meshes), combined here; pipeline stages hold disjoint parameters, so their squared norms are
    summed over ``pp_group``.
    """
    from torch.distributed.tensor import DTensor

    params = list(params)
    by_mesh = _by_grad_mesh(params)
    if not by_mesh:  # on the parameters' device: NCCL refuses CPU tensors in the pp all-reduce below
        norm = torch.zeros((), device=params[0].device if params else None)
    else:
        parts = []
        for group in by_mesh.values():
            part = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type, foreach=True)
            parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
        norm = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), norm_type)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        norm = norm**norm_type
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
        norm = norm ** (1.0 / norm_type)
    return norm


@torch.no_grad()
def clip_grads_with_norm_(params: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale every gradient by ``max_norm / total_norm`` (if below 1), one mesh at a time (DTensor ops do not
    cross meshes)."""
    for group in _by_grad_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)


def clip_grad_norm_(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradients on several meshes and plain ones (torch's refuses the mix,
    which tensor parallelism of only some modules gives); returns the total norm before clipping."""
    params = list(params)
    norm = total_grad_norm(params)
    clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _by_grad_mesh(params: Iterable[Tensor]) -> dict[object, list[Tensor]]:
    """Parameters with a gradient, grouped by the gradient's DTensor mesh (None: plain tensors)."""
    from torch.distributed.tensor import DTensor

    out: dict[object, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            out.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return out
