"""Parallel layout of the Qwen3-MoE family: Llama's top level and attention, plus q/k norms and the MoE layer.

Tensor parallel (with sequence parallel, as Llama): attention is Llama's (q/k/v column-wise, o row-wise);
the per-head q/k RMSNorms see only this rank's heads, so their weights are replicated DTensors over a
head-sharded input (``SequenceParallel(sequence_dim=2)``), which reduces their partial gradients.

The MoE layer is replicated over tp, by choice: its input is all-gathered to the whole sequence, every tp
rank routes and computes all tokens, and the output goes back to this rank's sequence slice (an all-gather
in backward). So every tp rank holds the full gradient of the router, experts and shared experts (nothing
is partial and nothing needs a reduction over tp), and the balancing statistics (auxiliary losses, token
counts for the expert bias) are those of whole sequences on every rank, as in one process. Without expert
parallel the cost is tp times the expert FLOPs. With ``parallel.ep`` the experts are split over ep x tp and
each tp rank computes only its share of the routed tokens (``strategies/expert_parallel.py``), which
gathers that share's gradients back so that everything here stays replicated over tp. TP-sharding each
expert's hidden width would leave the router's gradient partial over tp (the output is a partial sum).

Context parallel uses Llama's attention cores; the global-batch auxiliary loss then counts over the data x
context ranks (``MoE.count_group``, set by the strategy; cp2 x ep2 parity in
tests/parity/test_expert_parallel.py). The sequence-wise loss sums its per-sequence statistics over the
context ranks (``MoE.cp_group``, set by the module from the strategy's ``cp_group``).

Pipeline parallel: Llama's units (embedding, one per block, norm + head) and stage I/O. No stage but the last
returns a loss, so under the pipeline runner each MoE layer back-propagates its own share of the auxiliary
loss (``models/injected_loss.py``); the ``pooled`` loss, a product of sums over all layers, cannot be split so
and is refused with pp > 1 (``config/rules.py: moe_aux_loss_fits_pp``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from lit_titan.models.llama3.parallelize import (
    attention_cores,
    blocks,
    fsdp_units,
    pipeline_units,
    tp_root,
    tp_stage_io,
)
from lit_titan.models.llama3.parallelize import tp_block as llama_tp_block
from lit_titan.strategies.parallel_plan import ParallelPlan


def replicated_moe_style() -> Any:
    """The MoE layer replicated over tp (the module docstring says why), written by hand: no torch style
    replicates a module's weights while it runs on plain tensors. Its weights become Replicate DTensors (so
    FSDP, the grad norm and checkpoints see one mesh with the rest of the block); its input is gathered to
    the whole sequence; while it runs its weights are their local tensors (``to_local`` is differentiable:
    each rank's full gradient lands on the DTensor as a replicated one); its output goes back to Shard(1)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def replicate_params(name: str, module: nn.Module, mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param, mesh, [Replicate()])
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    def gather_input(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return (x.redistribute(placements=[Replicate()]).to_local(), *inputs[1:])

    class ReplicatedMoE(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            distribute_module(module, device_mesh, replicate_params, gather_input, shard_output)
            module.register_forward_pre_hook(partial(local_weights, mesh=device_mesh))
            module.register_forward_hook(restore_weights)
            return module

    return ReplicatedMoE()


def local_weights(module: nn.Module, inputs: tuple, mesh: Any) -> None:
    """Forward pre-hook: the weights ``replicated_moe_style`` made Replicate over ``mesh`` as their local tensors.

    Only those: the routed experts under ep are DTensors on the expert mesh, an FSDP unit of their own whose
    registered parameter FSDP's own hooks swap after this one runs. Swapped here too, ``restore_weights`` put
    a stale (sharded) parameter back, and under pp (no reshard between micro-batches) the next forward
    trained it directly, its gradient missing FSDP's divide factor (pp x ep x tp: about 1.5x)."""
    from torch.distributed.tensor import DTensor

    swapped = []
    for sub in module.modules():
        for pname, param in list(sub._parameters.items()):
            if isinstance(param, DTensor) and param.device_mesh == mesh:
                swapped.append((sub, pname, param))
                sub._parameters[pname] = param.to_local()
    module._replicated_params = swapped


def restore_weights(module: nn.Module, inputs: tuple, output: Any) -> None:
    """Forward hook: the DTensor weights ``local_weights`` swapped out, back in place."""
    for sub, pname, param in getattr(module, "_replicated_params", ()):
        sub._parameters[pname] = param
    module._replicated_params = []


def shard_output(module: nn.Module, output: Any, mesh: Any) -> Any:
    """The replicated MoE output -> this rank's sequence slice; backward all-gathers the slices' gradients,
    so every tp rank's router and experts get every token's gradient (nothing partial to reduce)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(output, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])


def tp_block(block: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import SequenceParallel

    plan = llama_tp_block(block)
    plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if block.moe is not None:
        for name in [k for k in plan if k.startswith("feed_forward")]:
            del plan[name]
        plan["moe"] = replicated_moe_style()
    return plan


QWEN3_MOE_PLAN = ParallelPlan(
    tp_root=tp_root,
    tp_block=tp_block,
    blocks=blocks,
    fsdp_units=fsdp_units,
    pipeline_units=pipeline_units,
    tp_stage_io=tp_stage_io,
    attention_cores=attention_cores,
)
