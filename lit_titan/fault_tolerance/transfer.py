"""Live state transfer: a rejoining replica group takes the weights and optimizer state of a live peer.

No checkpoint is read: the ranks at one shard position hold identically shaped shards in every
replica (same FSDP layout), so each tensor is broadcast over the new cross-replica group, from a
member that trained through the fault, in one fixed order (parameters, then each parameter's
optimizer state by key).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def materialise_optimizer_state(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (one step on zero gradients), so the peer's can be copied in.

    Generic over optimizers that create their state lazily in ``step``; the weights this step moves
    (weight decay) are overwritten by the transfer.
    """
    if all(optimizer.state.get(p) for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_tensors(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's local pieces of the weights and the optimizer state, in the transfer's order."""
    out = [_local(p.detach()) for p in params]
    for p in params:
        state = optimizer.state[p]
        out += [_local(state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return [t.view(1) if t.dim() == 0 else t for t in out]
