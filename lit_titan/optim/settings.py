"""``OptimConfig``: the optimizer and learning-rate schedule settings, what ``build.py`` builds from and
the schema's ``optim`` group (``conf/optim/*.yaml``) in one declaration; the choice lists they accept.

Free of torch on purpose: the config schema and ``--help`` import it before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_titan.settings import setting

# adamw (torch.optim.AdamW) | lamb (lit_titan.optim.lamb.Lamb: trust ratio from whole-parameter norms) |
# muon (lit_titan.optim.muon.Muon: orthogonalised momentum on hidden matrices, AdamW on the rest)
OPTIMIZERS = ("adamw", "lamb", "muon")
# fp32 (the states in the parameters' dtype: fp32 unless precision=bf16-true) | bf16 (stored in bf16, written
# back by stochastic rounding: optim/low_precision.py)
STATE_DTYPES = ("fp32", "bf16")
# "cosine": warmup, then cosine to min_lr; "wsd": warmup, stable, then linear decay over the last
# `decay_ratio` of training (warmup-stable-decay); "constant": warmup, then the peak lr.
SCHEDULES = ("cosine", "wsd", "constant")


def _betas(value: list[float]) -> str | None:
    if len(value) == 2 and all(0 <= b < 1 for b in value):
        return None
    return "not two numbers in [0, 1); use e.g. [0.9, 0.95]"


@dataclass
class OptimConfig:
    """The optimizer, its hyperparameters and the lr schedule (warmup, then ``schedule``)."""

    name: str = setting("adamw", choices=OPTIMIZERS)
    lr: float = setting(1e-3, gt=0)
    min_lr_ratio: float = setting(0.1, ge=0, le=1)
    betas: list[float] = setting(lambda: [0.9, 0.95], check=_betas)
    eps: float = setting(1e-8, gt=0)
    weight_decay: float = setting(0.1, ge=0)
    warmup_steps: int = setting(20, ge=0)
    schedule: str = setting("cosine", choices=SCHEDULES)
    decay_ratio: float = setting(0.2, ge=0, le=1)
    total_steps: int = setting(100, ge=1)
    # None: fused AdamW when every parameter is on CUDA, else torch's default (build.adamw_implementation)
    fused: bool | None = setting(None)
    foreach: bool | None = setting(None)
    # dtype the optimizer keeps its moments / momentum in (every optimizer)
    state_dtype: str = setting("fp32", choices=STATE_DTYPES)
    # Muon (optim=muon): momentum coefficient, Nesterov momentum, Newton-Schulz iterations
    momentum: float = setting(0.95, ge=0, lt=1)
    nesterov: bool = setting(True)
    ns_steps: int = setting(5, ge=1)
