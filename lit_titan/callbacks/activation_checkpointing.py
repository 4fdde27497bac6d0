"""Activation checkpointing of transformer blocks: none, full, selective per-op, every N layers."""

from __future__ import annotations

from functools import partial

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lit_titan.callbacks._requires import transform_strategy

MODES = ("none", "full", "selective_op", "selective_layer")

# Outputs worth keeping in selective per-op mode: the matmuls and attention (expensive to
# recompute, TorchTitan's choice), plus collectives (recomputing them would communicate again).
# Attention is named once per SDPA kernel torch may pick: flash/efficient/cuDNN on CUDA (cuDNN is
# preferred on H100 by recent torch), flash_for_cpu on CPU; ops a torch version lacks are skipped.
_SAVE_OP_NAMES = (
    "mm", "addmm",
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

    kwargs = {"context_fn": partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)} \
        if selective else {}
    return checkpoint_wrapper(block, checkpoint_fn=checkpoint, use_reentrant=False, preserve_rng_state=False,
                              **kwargs)


def apply_activation_checkpointing(model: nn.Module, container: nn.ModuleDict, mode: str,
                                   every_n_layers: int = 2) -> int:
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


class ActivationCheckpointing(L.Callback):
    """Trade compute for memory per transformer block; applied by the strategy after TP/CP and
    before compile and FSDP (so each checkpointed block is compiled and sharded as one unit)."""

    def __init__(self, mode: str = "selective_op", every_n_layers: int = 2) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {MODES}")
        if every_n_layers < 1:
            raise ValueError("every_n_layers must be >= 1")
        self.mode, self.every_n_layers = mode, every_n_layers
        self._registered = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = transform_strategy(trainer, "ActivationCheckpointing")
        if self.mode != "none" and not self._registered:
            strategy.register_transform("activation_checkpointing", self._apply)
            self._registered = True

    def _apply(self, model: nn.Module, plan, strategy) -> None:
        container = model.get_submodule(plan.block_container)
        apply_activation_checkpointing(model, container, self.mode, self.every_n_layers)
