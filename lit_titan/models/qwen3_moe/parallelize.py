"""Parallel layout of the Qwen3-MoE family: FSDP units as Llama's (one per block, experts inside it).

The top-level modules (embedding, final norm, head) carry Llama's names and layout. Tensor and pipeline
parallel are not planned yet: ``tp_block`` refuses, and no ``pipeline_units`` makes the strategy refuse
``parallel.pp > 1`` (the auxiliary loss is made on the last stage from every layer's statistics, which a
pipeline would need to carry across stages).
"""

from __future__ import annotations

from torch import nn

from lit_titan.models.llama3.parallelize import attention_cores, blocks, fsdp_units, tp_root
from lit_titan.models.qwen3_moe.model import Qwen3MoE
from lit_titan.strategies.parallel_plan import ParallelPlan, register_plan


def tp_block(block: nn.Module) -> dict:
    raise ValueError(
        "parallel.tp>1: the qwen3_moe family has no tensor-parallel plan yet (the router's and q/k norms' "
        "gradients are partial over tp); use parallel.tp=1 and parallel.dp_shard for the ranks"
    )


QWEN3_MOE_PLAN = ParallelPlan(
    tp_root=tp_root,
    tp_block=tp_block,
    blocks=blocks,
    fsdp_units=fsdp_units,
    attention_cores=attention_cores,
)
register_plan(Qwen3MoE, QWEN3_MOE_PLAN)
