"""Optimizer and learning-rate schedule construction (AdamW, LAMB or Muon + warmup then cosine or WSD)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from lit_titan.optim.settings import OPTIMIZERS, SCHEDULES, OptimConfig


def lr_lambda(cfg: OptimConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown optim.schedule={cfg.schedule!r}; choose one of {SCHEDULES}")
    warmup, total, floor = max(cfg.warmup_steps, 0), max(cfg.total_steps, 1), cfg.min_lr_ratio

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "cosine":
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_start = total - int(cfg.decay_ratio * total)
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start) / max(total - decay_start, 1), 1.0)
        return 1.0 - (1 - floor) * progress

    return fn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Norm weights (1-D) get no weight decay; every matrix does."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


AdamWImplementation = Literal["fused", "foreach", "for_loop"]


def adamw_implementation(
    params: Iterable[Any], *, fused: bool | None = None, foreach: bool | None = None
) -> AdamWImplementation:
    """Which AdamW kernel runs for ``params``; training and the planner's step time both ask this.

    Explicit settings are passed to torch unchanged: ``fused=True`` or ``foreach=True`` wins, and an
    explicit ``False`` with the other unset leaves torch's per-tensor loop. With neither set: the fused
    kernel when every parameter (a DTensor's local piece included) is a floating-point tensor on CUDA.
    torch would pick foreach there, one kernel per arithmetic op, which reads and writes the optimizer
    state about three times as often (the measured tokens/s gain: docs/benchmarks.md). Anywhere else:
    torch's own default, foreach on its other accelerators and the per-tensor loop on CPU, so CPU
    runs and their parity are unchanged. ``params`` may be anything with ``device`` and ``dtype`` (or
    ``to_local()`` returning such), so the planner can ask without building tensors.
    """
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if fused is not None or foreach is not None:  # torch: an explicit False turns the other default off
        return "for_loop"
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    if local and all(t.device.type == "cuda" and t.dtype.is_floating_point for t in local):
        return "fused"
    supported = _get_foreach_kernels_supported_devices()
    return "foreach" if local and all(t.device.type in supported for t in local) else "for_loop"


def check_optim(name: str, betas: Iterable[float], mup: bool = False) -> None:
    """ValueError naming the setting when ``optim.name`` or ``optim.betas`` cannot run (with ``model.mup``)."""
    from lit_titan.optim.lamb import check_betas
    from lit_titan.optim.mup import LR_EXPONENT

    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not an optimizer here; use optim=adamw, optim=lamb or optim=muon")
    if mup and name not in LR_EXPONENT:
        # LAMB's trust ratio rescales every layer's update to its weight norm: no published muP rule
        raise ValueError(
            f"optim.name={name}: model.mup=true has no per-layer lr rule for it; use optim=adamw or optim=muon"
        )
    check_betas(betas)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    from lit_titan.optim.low_precision import state_dtype
    from lit_titan.optim.mup import apply_mup_lr, width_multiplier

    check_optim(cfg.name, cfg.betas, mup=width_multiplier(model) is not None)
    dtype = state_dtype(cfg.state_dtype)
    if cfg.name == "muon":
        from lit_titan.optim.muon import Muon, muon_param_groups

        return Muon(
            apply_mup_lr(muon_param_groups(model, cfg.weight_decay), model, cfg.name, cfg.lr),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            state_dtype=dtype,
        )
    groups = apply_mup_lr(param_groups(model, cfg.weight_decay), model, cfg.name, cfg.lr)
    if cfg.name == "lamb":
        from lit_titan.optim.lamb import Lamb

        return Lamb(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, state_dtype=dtype)
    if dtype is not None:  # torch's AdamW keeps its moments in the parameters' dtype
        from lit_titan.optim.adamw import AdamW

        return AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, state_dtype=dtype)
    impl = adamw_implementation((p for g in groups for p in g["params"]), fused=cfg.fused, foreach=cfg.foreach)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=impl == "foreach", fused=impl == "fused"
    )


def keep_kernel_choice(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Make a checkpoint's optimizer state keep this process's AdamW kernel (call before loading it).

    ``Optimizer.load_state_dict`` takes every saved group hyperparameter, ``fused``/``foreach``
    included, and places the ``step`` counters by the saved ``fused`` flag: a checkpoint written by an
    earlier version (foreach on GPU) would turn fused off, one written on a GPU would run fused AdamW
    on CPU. The kernel belongs to where the parameters live now, so the current choice is kept.
    """
    for saved_group, group in zip(saved.get("param_groups", []), optimizer.param_groups):
        for key in ("fused", "foreach"):
            if key in group:
                saved_group[key] = group[key]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
