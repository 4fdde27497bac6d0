"""What a model family tells the strategy: its TP layout, its blocks, its FSDP units.

The model file stays free of parallel code; each family ships one ``ParallelPlan`` as its
``ModelSpec.plan`` (``models/registry.py``, the one place a plan is looked up). A model of no
registered family gets its plan from ``TitanStrategy(plan=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    # {submodule path: ParallelStyle} for the model's top-level modules (embeddings, norm, head)
    tp_root: Callable[[nn.Module, bool], dict]
    # the same for one transformer block
    tp_block: Callable[[nn.Module], dict]
    # the repeated blocks (activation checkpointing, compile and FSDP wrap each)
    blocks: Callable[[nn.Module], Iterable[nn.Module]]
    # FSDP units in forward order (a list groups modules into one all-gather)
    fsdp_units: Callable[[nn.Module], list]
    # attribute path of the ModuleDict holding the blocks (callbacks replace wrapped blocks there)
    block_container: str = "layers"
    # pipeline units in forward order, each a list of module names (embedding and head count as units)
    pipeline_units: Callable[[nn.Module], list[list[str]]] | None = None
    # (parent module, attribute) of each core attention op, swapped by context parallelism
    attention_cores: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    # TP styles for the root of a pipeline stage that lacks the first/last parts (stage boundaries)
    tp_stage_io: Callable[[nn.Module], list] | None = None
