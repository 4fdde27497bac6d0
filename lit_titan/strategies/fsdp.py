"""FSDP2 / HSDP application: one unit per block, then embeddings, norm+output, the root."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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
    if precision in ("32-true", "32"):
        return None, None
    raise ValueError(f"precision={precision!r} is not supported by TitanStrategy; use 32-true, bf16-mixed or bf16-true")


def apply_fsdp(units: list[nn.Module | list[nn.Module]], root: nn.Module, mesh, precision: str,
               cfg: FSDPConfig) -> None:
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
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                    cast_forward_inputs=cast_forward_inputs)

    kwargs = {"mesh": mesh}
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward and not last, mp_policy=policy(False),
                    **kwargs)
    fully_shard(root, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy(True), **kwargs)
