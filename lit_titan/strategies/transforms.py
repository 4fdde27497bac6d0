"""The transforms callbacks ask for, as plain functions: activation checkpointing, per-block compile, Float8.

``request_*`` registers a transform with ``TitanStrategy`` (``register_transform``); the strategy's
``parallelize`` runs the slots in its one fixed order (docs/architecture.md). The callbacks call
these in ``setup``; the planner (planner/build.py) calls them directly on the strategy it builds,
so both apply the same transforms without a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lit_titan.strategies.contract import contract
from lit_titan.strategies.settings import AC_MODES

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__all__ = [
    "MODES",
    "apply_activation_checkpointing",
    "compile_blocks",
    "request_activation_checkpointing",
    "request_compile",
    "request_float8",
]

MODES = AC_MODES  # the settings module declares them (the schema imports them from there)

# Outputs worth keeping in selective per-op mode: the matmuls and attention (expensive to
# recompute, TorchTitan's choice), plus collectives (recomputing them would communicate again).
# Attention is named once per SDPA kernel torch may pick: flash/efficient/cuDNN on CUDA (cuDNN is
# preferred on H100 by recent torch), flash_for_cpu on CPU; ops a torch version lacks are skipped.
_SAVE_OP_NAMES = (
    "mm",
    "addmm",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_mm",
)


def _save_ops() -> frozenset:
    ops = {getattr(torch.ops.aten, name).default for name in _SAVE_OP_NAMES if hasattr(torch.ops.aten, name)}
    for namespace in ("c10d_functional", "_c10d_functional"):
        if hasattr(getattr(torch.ops, namespace), "reduce_scatter_tensor"):
            ops.add(getattr(torch.ops, namespace).reduce_scatter_tensor.default)
    return frozenset(ops)


_SAVE_OPS = _save_ops()


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block: nn.Module, selective: bool) -> nn.Module:
    """``block`` under non-reentrant activation checkpointing (selective: per-op save policy).

    torch's ``checkpoint_wrapper`` lives in a private package, but DCP state dicts, FSDP and
    ``nn.Module`` attribute access all special-case exactly that wrapper (its
    ``_checkpoint_wrapped_module`` prefix is stripped from parameter names); a hand-written
    wrapper broke DCP saving, so we use torch's, as TorchTitan does.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = (
        {"context_fn": partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)} if selective else {}
    )
    return checkpoint_wrapper(block, checkpoint_fn=checkpoint, use_reentrant=False, preserve_rng_state=False, **kwargs)


def apply_activation_checkpointing(
    model: nn.Module, container: nn.ModuleDict, mode: str, every_n_layers: int = 2
) -> int:
    """Wrap blocks of ``container`` in place; returns how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {MODES}")
    wrapped = 0
    for key in list(container.keys()):
        if mode == "none":
            break
        if mode == "selective_layer" and int(key) % every_n_layers:
            continue
        container[key] = checkpointed(container[key], selective=(mode == "selective_op"))
        wrapped += 1
    return wrapped


def request_activation_checkpointing(strategy: Strategy, mode: str, every_n_layers: int = 2) -> None:
    """Checkpoint ``strategy``'s model blocks (``mode`` of MODES); applied after TP/CP, before compile and FSDP."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {MODES}")
    if every_n_layers < 1:
        raise ValueError("every_n_layers must be >= 1")
    if mode == "none":
        return

    def transform(model: nn.Module, plan: Any, strategy: Any) -> None:
        apply_activation_checkpointing(model, model.get_submodule(plan.block_container), mode, every_n_layers)

    contract(strategy).register_transform("activation_checkpointing", transform)


def compile_blocks(
    model: nn.Module, plan: Any, *, fullgraph: bool = True, backend: str = "inductor", mode: str | None = None
) -> None:
    """Compile each block in place (``nn.Module.compile``: parameter names stay unchanged); lazy, so free on meta."""
    for block in plan.blocks(model):
        block.compile(fullgraph=fullgraph, backend=backend, mode=mode)


def request_compile(
    strategy: Strategy, *, fullgraph: bool = True, backend: str = "inductor", mode: str | None = None
) -> None:
    """Compile ``strategy``'s model per block (TorchTitan's granularity); after TP and AC, before FSDP.

    Safe with TP because the residual stream between blocks stays a Shard(1) DTensor (see
    lit_titan/models/llama3/parallelize.py; local tensors there train silently wrong under compile).
    """
    titan = contract(strategy)

    def transform(model: nn.Module, plan: Any, strategy: Any) -> None:
        # Under CP the attention core stays eager (ContextParallel.apply disables it for dynamo): one graph
        # break per block, so fullgraph cannot hold there.
        dims = contract(strategy).parallel_dims
        cp = dims is not None and dims.cp > 1
        compile_blocks(model, plan, fullgraph=fullgraph and not cp, backend=backend, mode=mode)

    titan.register_transform("compile", transform)


def request_float8(
    strategy: Strategy,
    convert: Callable[[nn.Module, Any, Any], None],
    tp_style: Callable[[str, nn.Module, Any], Any] | None = None,
) -> None:
    """Convert ``strategy``'s model's Linears first (before pipeline split, TP, AC, compile and FSDP).

    ``convert``: the conversion (``Float8.convert``, which holds the recipe and the filter);
    ``tp_style``: with float8 TP, the rewrite of the plan's TP styles (``Float8.tp_style``).
    """
    titan = contract(strategy)
    titan.register_transform("convert", convert)
    if tp_style is not None:
        titan.register_tp_style_rewrite(tp_style)
