"""Expert load per MoE layer for the metrics: max/mean tokens per routed expert (1.0: balanced).

Read from the token counts each MoE layer already keeps from its last forward (``MoE.last_counts``, one
micro-batch), summed over the ranks that share the global batch (``batch_group``: data x context) in one
all-reduce of a [layers, experts] tensor, on logging steps only (the module calls it there). Every rank
gets the same numbers, so they are logged without another reduction. The run report plots them
(report/figures.py) and ``lit-titan plan plan.expert_imbalance=X`` takes the max/mean as its input.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_titan.models.moe import MoE

PREFIX = "moe/load_max_mean/"


def expert_load_metrics(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """``{"moe/load_max_mean/layer{i}": max/mean}`` for each MoE layer (``i``: its block index) with counts;
    {} for a dense model (no collective then)."""
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    named = [(name, m.last_counts) for name, m in named if getattr(m, "last_counts", None) is not None]
    if not named:
        return {}
    counts = torch.stack([c for _, c in named])
    if group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
    return {f"{PREFIX}layer{_block(name, k)}": ratio[k] for k, (name, _) in enumerate(named)}


def _block(name: str, k: int) -> int:
    """The block index in a module name (``layers.3.moe`` -> 3), else the layer's position."""
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else k
