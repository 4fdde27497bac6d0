"""Known-norm check: every gradient set to one before the global norm, which must then be sqrt(parameters).

Why: the clipping norm sums every parameter's gradient over every mesh it is spread over (FSDP shards, TP
pieces, pipeline stages, the experts' own mesh). A parameter left out of that sum, or counted once per rank
that holds a copy, shifts the norm by a little and clips every step a little wrong, which a loss curve never
shows. With every gradient one the right answer is known without a reference: sqrt of the number of trained
parameters, each counted once. The count is taken from the parameters' global shapes (DTensors report the whole
tensor; pipeline stages hold disjoint parameters and are summed over the pipeline group), not from the norm's
code. The step it runs on trains on those ones: run it in a check, not in a job whose weights matter.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lit_titan.strategies.contract import contract, module_contract


class KnownNormCheck(pl.Callback):
    """At optimizer step ``step``: gradients set to one, then the module's global norm read back.

    ``expected`` and ``measured`` hold the two numbers afterwards (every rank); ``relative_error`` their gap."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.expected: float | None = None
        self.measured: float | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # Callbacks run before the module's own hook, which computes the norm from these gradients.
        if trainer.global_step != self.step:
            return
        trained = [p for p in pl_module.parameters() if p.requires_grad]
        for p in trained:
            if p.grad is not None:  # one without a gradient is one the norm cannot see: counted below anyway
                _ones_(p.grad)
        strategy = contract(trainer.strategy)
        count = torch.tensor(float(sum(p.numel() for p in trained)), dtype=torch.float64, device=strategy.root_device)
        pp_group = strategy.pp_group
        if pp_group is not None:
            dist.all_reduce(count, group=pp_group)
        self.expected = math.sqrt(count.item())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self.expected is None or self.measured is not None:
            return
        norm = module_contract(pl_module).last_grad_norm
        if norm is not None:
            self.measured = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    @property
    def relative_error(self) -> float:
        if self.expected is None or self.measured is None:
            return math.nan
        return abs(self.measured - self.expected) / self.expected


def _ones_(grad: torch.Tensor) -> None:
    """Set the whole gradient to ones. A DTensor pending a sum over some mesh dims (``Partial``: the norms' gradients
    under sequence parallel) holds a share per rank: each rank's local piece gets 1 / (ranks summed over)."""
    if not isinstance(grad, DTensor):
        grad.fill_(1.0)
        return
    share = 1.0
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial() and getattr(placement, "reduce_op", "sum") == "sum":
            share /= grad.device_mesh.size(dim)
    grad.to_local().fill_(share)
