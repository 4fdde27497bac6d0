"""Optimizer states kept in bf16 (``optim.state_dtype=bf16``): half the bytes of fp32 moments.

Why stochastic rounding: an exponential moving average in bf16 with round-to-nearest stalls. With 8
mantissa bits, ``m = 0.95 m + 0.05 g`` changes ``m`` by less than half an ulp whenever ``g`` is
within a few percent of ``m``, so the update rounds away and the average stops tracking; Adam's
``v`` (beta2 0.95-0.999) is worse. Rounding up or down at random, with the probability of the
distance to each neighbour, makes the stored value unbiased (its expectation is the fp32 value), so
the averages keep moving on average (Zamirai et al. 2020, "Revisiting BFloat16 Training").

The arithmetic of a step runs in fp32 (fp64 under ``precision=64-true``) on a transient copy of one
parameter's states at a time; only the stored state is bf16. The noise of an element is a hash of its
index in the whole parameter, the optimizer step and which state it is, not a draw from a generator: a
run and its resume draw the same noise, replicas of a parameter (HSDP, TP-replicated norms) stay bitwise
equal, and so does any layout with one process, whose shards would otherwise each draw their own
sequence (``lit-titan verify`` compares the states' effect on the weights at 1e-9).
"""

from __future__ import annotations

import torch
from torch import Tensor

# fp32: the states in the parameters' own dtype, as torch's optimizers keep them (fp32 unless
# precision=bf16-true); bf16: always bf16
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
_SEED = 0x5EED


def state_dtype(name: str) -> torch.dtype | None:
    """``optim.state_dtype`` as a torch dtype (None: the parameter's), or ValueError naming the setting."""
    if name not in DTYPES:
        raise ValueError(f"optim.state_dtype={name!r}: not an option; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


class StateRounding:
    """Writes computed values into stored states: a plain copy, or stochastic rounding into bf16."""

    def __init__(self) -> None:
        self._step = 0
        self._coordinates: dict[tuple, tuple[Tensor, ...] | None] = {}

    def start_step(self, step: int) -> None:
        """The optimizer step the noise of the next stores is keyed by (restored by a resume); once per step."""
        self._step = int(step)

    def store_(self, dst: Tensor, src: Tensor, like: Tensor | None = None, salt: int = 0) -> None:
        """``dst.copy_(src)``, rounding stochastically when ``dst`` is bf16 and ``src`` wider.

        ``dst`` and ``src`` are local pieces of ``like`` (the parameter, a DTensor when sharded); ``salt`` tells the
        states of one parameter apart (0: first moment, 1: second)."""
        if dst.dtype == torch.bfloat16 and src.dtype in (torch.float32, torch.float64):
            index = self._global_index(src, like)
            dst.copy_(stochastic_round(src.float(), noise=_hash16(index, self._step, salt)))
        else:
            dst.copy_(src)

    def _global_index(self, local: Tensor, like: Tensor | None) -> Tensor:
        """Each local element's flat index in the whole parameter (its local index when it is not sharded)."""
        spec = getattr(like, "_spec", None)
        if spec is None or like is None:
            return torch.arange(local.numel(), device=local.device).view(local.shape)
        key = (tuple(like.shape), spec.placements, id(spec.mesh), local.device)
        if key not in self._coordinates:
            self._coordinates[key] = _coordinates(like, spec, local.device)
        coords = self._coordinates[key]
        if coords is None or tuple(len(c) for c in coords) != tuple(local.shape):
            return torch.arange(local.numel(), device=local.device).view(local.shape)  # a layout not understood
        index = torch.zeros((), dtype=torch.int64, device=local.device)
        stride = 1
        for dim in reversed(range(local.dim())):
            shape = [1] * local.dim()
            shape[dim] = -1
            index = index + coords[dim].view(shape) * stride
            stride *= like.shape[dim]
        return index


def _coordinates(like: Tensor, spec, device: torch.device) -> tuple[Tensor, ...] | None:
    """Per dim of ``like``: the whole-tensor coordinates of this rank's piece along it.

    DTensor's own slicing of a 1-D ``arange`` with the placements that split that dim (FSDP's strided shard over
    TP's included): no communication, and no rule of how a dim is split restated here."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    coords = []
    for dim, size in enumerate(like.shape):
        placements = []
        for p in spec.placements:
            if isinstance(p, Shard) or type(p).__name__ == "_StridedShard":
                if p.dim != dim:
                    placements.append(Replicate())
                elif type(p).__name__ == "_StridedShard":
                    placements.append(type(p)(0, split_factor=p.split_factor))
                else:
                    placements.append(Shard(0))
            elif p.is_replicate():
                placements.append(Replicate())
            else:
                return None  # a Partial parameter: not one lit-titan makes
        arange = torch.arange(size, device=device)
        coords.append(distribute_tensor(arange, spec.mesh, placements, src_data_rank=None).to_local())
    return tuple(coords)


# splitmix64's finaliser constants (as signed int64: torch's integer arithmetic wraps)
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _wrap(value: int) -> int:
    """A Python integer as the int64 torch's wrapping arithmetic would hold."""
    return (value + 2**63) % 2**64 - 2**63


def _hash16(index: Tensor, step: int, salt: int) -> Tensor:
    """16 uniform bits per element from (index, step, salt): splitmix64's finaliser, as int32 in [0, 2^16)."""
    x = index * _GOLDEN + _wrap(((_SEED + step) * 4 + salt) * _MIX2)
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * _MIX1  # logical shifts: mask the sign bits an arithmetic shift copies
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * _MIX2
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return ((x >> 24) & 0xFFFF).to(torch.int32)


def stochastic_round(src: Tensor, generator: torch.Generator | None = None, noise: Tensor | None = None) -> Tensor:
    """fp32 -> bf16, rounding to one of the two neighbouring bf16 values with probability by distance.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits of the
    bit pattern and truncating them carries into the kept bits with exactly that probability (on the
    magnitude, so negative values round symmetrically). The truncated value is a bf16 value, so the
    final cast is exact. ``noise``: those 16 bits per element (int32), else drawn from ``generator``.
    """
    bits = src.contiguous().view(torch.int32)
    if noise is None:
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


__all__ = ["DTYPES", "StateRounding", "state_dtype", "stochastic_round"]
