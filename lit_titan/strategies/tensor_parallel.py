"""Tensor + sequence parallel application from a model family's per-module plan."""

from __future__ import annotations

from torch import nn

from lit_titan.strategies.plan import ParallelPlan


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: ParallelPlan, loss_parallel: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan.tp_root(model, loss_parallel))
    for block in plan.blocks(model):
        parallelize_module(block, tp_mesh, plan.tp_block(block))
    for style in plan.tp_stage_io(model) if plan.tp_stage_io else ():
        parallelize_module(model, tp_mesh, style)
