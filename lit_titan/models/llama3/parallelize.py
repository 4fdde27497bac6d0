"""Parallel layout of the Llama 3.1 family (TorchTitan's plan, with one deliberate change).

Change: the residual stream between blocks stays a Shard(1) DTensor (``use_local_output=False``
on the embedding, attention.wo and feed_forward.w2). With local tensors there, torch.compile x TP
crashes in backward and FSDP x TP x compile trains silently wrong, with no error raised (torch 2.13
and 2.14; tests/unit/callbacks/test_callbacks.py::test_compile_x_tp_x_fsdp_matches_eager_single_process guards it).
"""

from __future__ import annotations

import functools

from torch import nn

from lit_titan.strategies.parallel_plan import ParallelPlan


def tp_root(model: nn.Module, loss_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = LossHeadColwise(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


@functools.cache
def _loss_head_style() -> type:
    from torch.distributed.tensor.parallel import ColwiseParallel

    class LossHeadColwise(ColwiseParallel):
        """ColwiseParallel for a head that returns logits or, given labels, a scalar loss.

        The loss (a Replicate DTensor under loss parallel) is handed back as a plain tensor
        instead of being redistributed to the logits' layout, which a 0-d tensor cannot take.
        """

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            if outputs.ndim == 0:
                return outputs.full_tensor()
            return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    return LossHeadColwise


def LossHeadColwise(**kwargs):  # noqa: N802 - a style constructor, named like one
    return _loss_head_style()(**kwargs)


def tp_block(block: nn.Module) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if getattr(block, "parallel", False):
        return _tp_parallel_block()
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
    }


def _tp_parallel_block() -> dict:
    """The parallel block under TP + SP: one all-gather of norm(x) (``fork``) feeds both branches, and
    wo / w2 keep their outputs as partial sums, added and reduce-scattered once (``join``).
    The sequential block pays an all-gather and a reduce-scatter per branch."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "attention_norm": SequenceParallel(),
        "fork": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "attention": PrepareModuleInput(
            input_layouts=(Replicate(), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        "feed_forward": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
        "join": PrepareModuleInput(
            input_layouts=(Partial(),), desired_input_layouts=(Shard(1),), use_local_output=False
        ),
    }


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values())


def fsdp_units(model: nn.Module) -> list:
    # Tied embeddings: the one weight stays with the root unit (an FSDP unit each for the embedding
    # and the head would shard, gather and reduce the same parameter twice).
    tied = model.args.tie_embeddings
    units: list = []
    if model.tok_embeddings is not None and not tied:
        units.append(model.tok_embeddings)
    units.extend(model.layers.values())
    tail = [m for m in (model.norm, None if tied else model.output) if m is not None]
    if tail:
        units.append(tail)
    return units


def pipeline_units(model: nn.Module) -> list[list[str]]:
    return [["tok_embeddings"], *[[f"layers.{k}"] for k in model.layers], ["norm", "output"]]


def tp_stage_io(model: nn.Module) -> list:
    """Pipeline stages exchange plain tensors: the residual stream's local Shard(1) piece."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

    styles = []
    if model.tok_embeddings is None:  # receives hidden states: make them the Shard(1) DTensor again
        styles.append(
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=False)
        )
    if model.output is None:  # sends hidden states: the local piece
        styles.append(
            PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True)
        )
    return styles


def attention_cores(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(block.attention, "core") for block in blocks(model)]


LLAMA3_PLAN = ParallelPlan(
    tp_root=tp_root,
    tp_block=tp_block,
    blocks=blocks,
    fsdp_units=fsdp_units,
    pipeline_units=pipeline_units,
    tp_stage_io=tp_stage_io,
    attention_cores=attention_cores,
)
