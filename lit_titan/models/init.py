"""Layout-independent, seeded parameter initialisation.

Why not one global generator: a pipeline stage owns only some parameters and an FSDP/TP rank
only a shard of each, so a shared random stream would give every layout different weights.
Instead each parameter draws from its own generator, seeded by (seed, parameter name), over its
*full* shape; a sharded parameter (DTensor) then keeps only its local piece. The same name and
seed therefore give the same values on one device and under any parallel layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import Tensor

InitFn = Callable[[Tensor, torch.Generator], None]


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_init_(param: Tensor, name: str, seed: int, fn: InitFn) -> None:
    """Fill ``param`` in place with ``fn`` drawn over its full shape from a per-name generator."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            device = param.to_local().device
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            gen = torch.Generator(device=device).manual_seed(param_seed(seed, name))
            fn(full, gen)
            # src_data_rank=None: every rank already holds the same full tensor, so each just
            # keeps its own piece (no scatter from rank 0).
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            gen = torch.Generator(device=param.device).manual_seed(param_seed(seed, name))
            fn(param, gen)


def normal(std: float, trunc: float | None = None) -> InitFn:
    """Normal (optionally truncated at ``trunc`` std) initialiser."""

    def fn(t: Tensor, g: torch.Generator) -> None:
        if trunc is None:
            t.normal_(0.0, std, generator=g)
        else:
            torch.nn.init.trunc_normal_(t, mean=0.0, std=std, a=-trunc * std, b=trunc * std, generator=g)

    return fn


def ones() -> InitFn:
    def fn(t: Tensor, g: torch.Generator) -> None:
        t.fill_(1.0)

    return fn


# Wrappers that insert themselves into parameter names (activation checkpointing, torch.compile
# of a module object); stripped so init seeds and checkpoints keep the model's own names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
