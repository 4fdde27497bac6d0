"""Users' ``PretrainModule`` subclasses, trained as layouts by the parity tests (tests/parity/test_user_loss.py)
and named on the command line by ``module._target_=user_modules.NAME`` (tests/support is on sys.path).

A world runs one through ``parity.train_user_case``, which hands the job this class in place of
``PretrainModule`` for the case.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lit_titan import PretrainModule

IGNORE = -100


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 for the loss (bf16 logits upcast), float64 in a float64 run (``precision=64-true``)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class MaskedLabels(PretrainModule):
    """Ignores every label after a prefix whose length (1 to seq_len) the sequence's first token decides: the
    valid counts differ between sequences, ranks, micro-batches and context-parallel chunks, whatever the layout.
    The loss is the default ``F.cross_entropy`` mean (it ignores -100)."""

    def split_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = super().split_batch(batch)
        keep = 1 + batch[:, 0] % labels.shape[1]
        position = torch.arange(labels.shape[1], device=labels.device)
        return inputs, labels.masked_fill(position[None, :] >= keep[:, None], IGNORE)


class MaskedLabelsOwnLoss(MaskedLabels):
    """The same loss written by the user, as one loss per target (zero where ignored)."""

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(_wide(logits.flatten(0, 1)), labels.flatten(), ignore_index=IGNORE, reduction="none")
        return losses.view_as(labels)


class SmoothedLoss(PretrainModule):
    """The README's subclass: label smoothing."""

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_wide(logits.flatten(0, 1)), labels.flatten(0, 1), label_smoothing=0.1)


class ScaledLoss(PretrainModule):
    """A subclass with a constructor argument of its own (``+module.scale=2.0``): the default loss times ``scale``."""

    def __init__(self, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = scale

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.scale * super().compute_loss(logits, labels)
