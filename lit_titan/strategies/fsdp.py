"""FSDP2 / HSDP application: one unit per block, then embeddings, norm+output, the root.

Also what gradient accumulation does to FSDP's reductions (``parallel.grad_reduce_scatter``, choices in
``strategies/settings.py``) and how much
gradient storage a rank really holds (``gradient_storage_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

# torch's pipeline stage turns FSDP's gradient sync off for its own micro-batches and reduces at the
# end of every schedule step (PipelineStage.perform_reduce_grad), overriding block_backward_sync.
PP_LAST_MICROBATCH = (
    "parallel.grad_reduce_scatter=last_microbatch cannot apply under parallel.pp > 1: torch's "
    "pipeline schedule reduces the gradients at the end of every schedule step; use "
    "parallel.grad_reduce_scatter=every_microbatch"
)


@dataclass(frozen=True)
class FSDPConfig:
    # True: free the unsharded params after forward (less memory, one more all-gather in backward).
    reshard_after_forward: bool = True
    cpu_offload: bool = False


def mixed_precision_for(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) for a Lightning precision flag."""
    if precision == "bf16-mixed":
        return torch.bfloat16, torch.float32
    if precision in ("bf16-true", "bf16"):
        return torch.bfloat16, torch.bfloat16
    if precision in ("32-true", "32", "64-true", "64"):
        return None, None
    raise ValueError(
        f"precision={precision!r} is not supported by TitanStrategy; use 32-true, bf16-mixed, bf16-true or 64-true"
    )


def apply_fsdp(
    units: list[nn.Module | list[nn.Module]], root: nn.Module, mesh, precision: str, cfg: FSDPConfig
) -> None:
    """Shard each unit (a module or a list of modules sharing one all-gather), then the root.

    The last unit is kept unsharded after forward: backward needs it at once.

    Only the root casts its floating-point forward inputs to the parameter dtype (FSDP1's
    ``cast_root_forward_inputs`` behaviour). Inside the model every activation already comes out of
    bf16 parameters; what reaches a unit in fp32 is fp32 on purpose. Casting per unit (FSDP2's
    default) rounded the rotary cos/sin tables, which the model passes to every block, to bf16:
    about 2e-3 relative error in every rotated query and key.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype = mixed_precision_for(precision)

    def policy(cast_forward_inputs: bool) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_forward_inputs
        )

    kwargs = {"mesh": mesh}
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        fully_shard(
            unit, reshard_after_forward=cfg.reshard_after_forward and not last, mp_policy=policy(False), **kwargs
        )
    fully_shard(root, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy(True), **kwargs)


def apply_expert_fsdp(experts: list[nn.Module], mesh, precision: str, cfg: FSDPConfig, divide_factor: int) -> None:
    """Shard expert modules (weights already EP-sharded DTensors) over the expert-FSDP mesh (``efsdp``,
    with HSDP ``dp_replicate x efsdp``), each its own unit, before the blocks that hold them are wrapped.

    ``divide_factor``: the dp x cp size. An expert's gradient already sums the tokens of every EP
    rank (the all-to-all's backward), so FSDP's default, the mean over its own mesh (dp x cp / ep
    ranks), would make it ``ep`` times too large.

    FSDP reduce-scatters with a pre-multiplied sum for a factor other than its mesh size, which gloo
    lacks, so sharded experts reduce with SUM and divide after. Not when the experts' shard dim has
    one rank (``ep`` = dp_shard x cp): there FSDP divides by a given factor in its single-rank copy
    *and* again where it reduces by SUM (forced, or its path for dtypes other than fp32/bf16: float64),
    a gradient ``divide_factor`` times too small. So there FSDP keeps its default (the mean over its
    mesh: the HSDP replicas, else nothing) and a hook after its reduction divides by the rest.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype = mixed_precision_for(precision)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    kwargs = {"offload_policy": CPUOffloadPolicy()} if cfg.cpu_offload else {}
    sharded = mesh.size(mesh.ndim - 1) > 1
    rest = float(divide_factor) / mesh.size()
    for module in experts:
        fully_shard(module, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy, **kwargs)
        if sharded:
            module.set_gradient_divide_factor(float(divide_factor))
            module.set_force_sum_reduction_for_comms(True)
        elif rest != 1:
            module.set_all_reduce_hook(partial(_divide_, rest))


def _divide_(factor: float, reduced: torch.Tensor) -> None:
    reduced.div_(factor)


def fsdp_modules(roots: Iterable[nn.Module]) -> list[nn.Module]:
    """Every ``FSDPModule`` under ``roots``, each once (pipeline stage views share modules)."""
    from torch.distributed.fsdp import FSDPModule

    return list({id(m): m for r in roots for m in r.modules() if isinstance(m, FSDPModule)}.values())


def fsdp_param_groups(roots: Iterable[nn.Module]) -> list:
    """FSDP2's parameter groups under ``roots``, each once (one per ``fully_shard`` call with parameters).

    A unit sharded as a list of modules (norm + output) shares one state between its modules. These
    are FSDP internals, read with ``getattr`` (torch 2.11-2.15: ``_fsdp_param_group`` or ``_fsdp_param_groups``).
    """
    groups: dict[int, object] = {}
    for module in fsdp_modules(roots):
        state = module._get_fsdp_state()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:
            found = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in found:
            if group.fsdp_params:
                groups.setdefault(id(group), group)
    return list(groups.values())


def gradient_storage_bytes(roots: Iterable[nn.Module]) -> int:
    """Bytes of gradient storage this rank holds now, wherever FSDP2 keeps it.

    Counts each distinct storage once: the parameters' ``.grad`` (a DTensor's local shard), the
    unsharded gradients FSDP accumulates while its gradient sync is off (on its ``FSDPParam``s:
    ``unsharded_accumulated_grad`` and the unsharded parameter's ``.grad``), and HSDP's buffer of
    reduce-scattered gradients awaiting the all-reduce (``_partial_reduce_output``). The parameters'
    ``.grad`` alone would not show the unsharded gradients that accumulation without sync keeps.
    """
    roots = list(roots)
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        t = t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor: this rank's piece
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return
        seen.add(storage.data_ptr())
        total += storage.nbytes()

    for root in roots:
        for p in root.parameters():
            add(p.grad)
    for group in fsdp_param_groups(roots):
        add(getattr(group, "_partial_reduce_output", None))
        for fsdp_param in group.fsdp_params:
            add(getattr(fsdp_param, "unsharded_accumulated_grad", None))
            add(getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None))
    return total
