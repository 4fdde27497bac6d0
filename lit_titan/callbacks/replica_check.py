"""Replica-divergence check: every piece of state that several ranks hold a copy of is bitwise equal on all of them.

Why: replicated state (HSDP's replicas of each shard, tensor-parallel copies of norms and biases, their optimizer
moments) is supposed to stay identical because every copy takes the same update. A missed reduction, a
rank-dependent random draw, or a node that corrupts memory makes one copy drift; training goes on, each replica
now slightly different, and no loss curve shows it. Megatron checks parameter hashes across replicas for the same
reason. Here, after the optimizer step every ``every_n_steps`` steps, each rank hashes its local piece of every
parameter and optimizer-state tensor, the hashes are gathered over each mesh dim the tensor is ``Replicate`` on
(plain tensors: over every rank, without pipeline parallelism, where all ranks hold them), and any disagreement
is reported by name, mesh dim and ranks. One gather of small strings per replicated group per check: cheap next
to a step, and meant for checks (``lit-titan verify``, a periodic guard), not every step of a job.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lit_titan.callbacks.settings import ReplicaCheckConfig
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import contract


class ReplicaDivergenceError(RuntimeError):
    """Copies of one tensor differ between ranks that should hold the same bits."""


class ReplicaDivergenceCheck(pl.Callback):
    """After the optimizer step of every ``every_n_steps``-th step: replicated state bitwise equal on its ranks.

    ``action="raise"`` stops the run with a one-line :class:`ReplicaDivergenceError`; ``"record"`` keeps the findings
    in ``divergent`` (``"name [mesh dim]: ranks r0, r1 differ"``) for a report. ``checked`` counts the tensors compared.
    """

    def __init__(self, settings: ReplicaCheckConfig | None = None, **keys: Any) -> None:
        s = self.settings = settings_of(ReplicaCheckConfig, settings, keys)
        if s.action not in ("raise", "record"):
            raise ValueError(f"ReplicaDivergenceCheck(action={s.action!r}): choose raise or record")
        if s.every_n_steps < 1:
            raise ValueError("ReplicaDivergenceCheck every_n_steps must be >= 1")
        self.every_n_steps = int(s.every_n_steps)
        self.action = s.action
        self.divergent: list[str] = []
        self.checked = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps or not dist.is_initialized():
            return
        found = self.check(pl_module, trainer.optimizers, contract(trainer.strategy).pp_group is None)
        self.divergent += found
        if found and self.action == "raise":
            raise ReplicaDivergenceError(
                f"step {trainer.global_step}: {len(found)} replicated tensor(s) differ between ranks that hold "
                f"copies, first {found[0]}"
            )

    def check(self, module: torch.nn.Module, optimizers: list[Any], plain_everywhere: bool) -> list[str]:
        """Every replicated tensor's hash gathered over its replica groups; the entries whose copies differ."""
        by_group: dict[Any, dict[str, str]] = defaultdict(dict)
        for name, tensor in _state(module, optimizers):
            for group, where in _replica_groups(tensor, plain_everywhere):
                by_group[group][f"{name} [{where}]"] = _digest(tensor)
        found = []
        for group, digests in by_group.items():  # the same order on every rank: the module's own order
            gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, digests, group=group)
            self.checked += len(digests)
            for key in digests:
                copies = [g[key] for g in gathered]
                if len(set(copies)) > 1:
                    ranks = dist.get_process_group_ranks(group)
                    odd = [r for r, c in zip(ranks, copies) if c != copies[0]]
                    found.append(f"{key}: ranks {ranks[0]} and {', '.join(map(str, odd))} differ")
        # every rank sees every group's findings (and raises alike: a raise on some ranks would hang the others)
        everyone: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        return list(dict.fromkeys(entry for part in everyone for entry in part or []))


def _state(module: torch.nn.Module, optimizers: list[Any]):
    """(name, tensor) of every parameter, every tensor of its optimizer state, and every persistent buffer (an MoE
    layer's expert bias: every rank updates its own copy from counts all of them must have summed)."""
    for name, param in module.named_parameters():
        yield name, param
        for optimizer in optimizers:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:  # a step count is the same by construction
                    yield f"{name}.{key}", value
    for prefix, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def _replica_groups(tensor: torch.Tensor, plain_everywhere: bool):
    """(process group, where) for each set of ranks that hold the same copy of ``tensor``."""
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        for dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                yield mesh.get_group(dim), mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"mesh dim {dim}"
    elif plain_everywhere and dist.get_world_size() > 1:
        yield dist.group.WORLD, "world"


def _digest(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    raw = local.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()
