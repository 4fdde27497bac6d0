"""Loss terms a layer back-propagates where it is made, instead of returning them with the model's loss.

Why: under pipeline parallelism only the last stage returns a loss, so a term made inside an earlier
stage's layer (an MoE layer's auxiliary loss) cannot be added to it. Such a layer passes its hidden
state through ``add_to_backward``: forward returns it unchanged, backward also sends the term a
gradient of ``scale``, as if ``scale * term`` had been added to the returned loss (Megatron's
``MoEAuxLossAutoScaler``, DeepSeek-V3's ``AddAuxiliaryLoss``; torch has no such op).

The pipeline runner opens ``losses_in_backward(scale)`` around its schedule step with the factor it
applies to the returned loss (1 / (micro-batches x accumulation)). Outside such a scope a layer does
not inject anything and the model adds its terms to its loss as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_scale: float | None = None


@contextmanager
def losses_in_backward(scale: float) -> Iterator[None]:
    """Layers that make loss terms back-propagate them themselves, each times ``scale``, while this is open."""
    global _scale
    previous, _scale = _scale, float(scale)
    try:
        yield
    finally:
        _scale = previous


def backward_scale() -> float | None:
    """The open scope's factor; None: no scope open (the model returns its terms with its loss)."""
    return _scale


class _AddToBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, term: Tensor, scale: float) -> Tensor:
        # the term's shape, not the term: its gradient is a constant, so backward unpacks no saved tensor
        ctx.term = (term.shape, term.dtype, term.device)
        ctx.scale = scale
        return hidden

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.term
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def add_to_backward(hidden: Tensor, term: Tensor, scale: float) -> Tensor:
    """``hidden`` unchanged; its backward also back-propagates the scalar ``term`` times ``scale``."""
    return _AddToBackward.apply(hidden, term, scale)
