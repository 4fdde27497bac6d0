"""Optimizer and learning-rate schedule construction (AdamW + warmup then cosine or WSD)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    # "cosine": warmup, then cosine to min_lr; "wsd": warmup, stable, then linear decay over
    # the last `decay_ratio` of training (warmup-stable-decay).
    schedule: str = "cosine"
    decay_ratio: float = 0.2
    total_steps: int = 100
    foreach: bool | None = None
    fused: bool | None = None


SCHEDULES = ("cosine", "wsd", "constant")


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


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
        foreach=cfg.foreach, fused=cfg.fused,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
