"""AdamW with its moments in a chosen dtype (``optim.state_dtype``), and the AdamW half of Muon.

Why hand-written: ``torch.optim.AdamW`` keeps its moments in the parameter's dtype, so fp32
parameters get fp32 moments; bf16 moments need the update written out. ``optim=adamw`` with fp32
states still builds ``torch.optim.AdamW`` (its fused and foreach kernels, unchanged numerics). This one
runs per parameter on the local piece of a sharded (DTensor) parameter: AdamW is elementwise, so
shards need no communication. Per parameter and not foreach, so the fp32 copies of bf16 moments
exist for one parameter at a time (the saving holds at the step's peak too).

The update (torch's AdamW), per parameter ``w`` with gradient ``g`` at step ``t``::

    w *= 1 - lr * wd
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lit_titan.optim.lamb import _like_param, _local, check_betas
from lit_titan.optim.low_precision import StateRounding


def init_adam_state(state: dict[str, Any], p: Tensor, dtype: torch.dtype | None) -> None:
    """The moments (shaped and sharded like ``p``, in ``dtype``; None: ``p``'s) and the step count, on first use."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


def adamw_step_(
    p: Tensor, state: dict[str, Any], group: dict[str, Any], rounding: StateRounding, measure: bool = False
) -> Tensor | None:
    """One AdamW update of ``p`` (its local piece) from ``p.grad``; moments upcast to fp32 for the arithmetic.

    ``measure``: also return the sum of squares of the update per unit lr (weight decay aside), for its RMS.
    """
    b1, b2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    w, g = _local(p), _local(_like_param(p.grad, p))
    m_store, v_store = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
    state["step"] += 1
    t = float(state["step"])
    compute = torch.promote_types(w.dtype, torch.float32)  # fp32 arithmetic, fp64 under precision=64-true
    m, v = m_store.to(compute), v_store.to(compute)
    g = g.to(compute)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    rounding.store_(m_store, m, p, salt=0)
    rounding.store_(v_store, v, p, salt=1)
    if wd != 0:
        w.mul_(1 - lr * wd)
    denom = (v.sqrt() / (1 - b2**t) ** 0.5).add_(eps)  # not sqrt_: with fp32 states v is the state itself
    w.addcdiv_(m.to(w.dtype), denom.to(w.dtype), value=-lr / (1 - b1**t))
    return (m / denom).square_().sum() / (1 - b1**t) ** 2 if measure else None


class AdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in ``state_dtype`` (bf16: stochastic rounding, optim/low_precision.py)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        betas = check_betas(betas)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self._rounding = StateRounding()
        self._steps = 0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = True
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                init_adam_state(self.state[p], p, self.state_dtype)
                if first:  # the step count every parameter shares (restored by a resume)
                    self._rounding.start_step(int(self.state[p]["step"]))
                    first = False
                adamw_step_(p, self.state[p], group, self._rounding)
        return loss


__all__ = ["AdamW", "adamw_step_", "init_adam_state"]
