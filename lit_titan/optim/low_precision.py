"""Optimizer states kept in bf16 (``optim.state_dtype=bf16``): half the bytes of fp32 moments.

Why stochastic rounding: an exponential moving average in bf16 with round-to-nearest stalls. With 8
mantissa bits, ``m = 0.95 m + 0.05 g`` changes ``m`` by less than half an ulp whenever ``g`` is
within a few percent of ``m``, so the update rounds away and the average stops tracking; Adam's
``v`` (beta2 0.95-0.999) is worse. Rounding up or down at random, with the probability of the
distance to each neighbour, makes the stored value unbiased (its expectation is the fp32 value), so
the averages keep moving on average (Zamirai et al. 2020, "Revisiting BFloat16 Training").

The arithmetic of a step runs in fp32 on a transient copy of one parameter's states at a time; only
the stored state is bf16. The noise comes from a generator seeded by the step count, so a run and
its resume draw the same noise, and replicas of a parameter (HSDP, TP-replicated norms), which hold
equal shapes and run the same sequence of draws, stay bitwise equal.
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
    """Writes fp32 values into stored states: a plain copy for fp32 states, stochastic rounding for bf16."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def start_step(self, step: int) -> None:
        """Reseed every generator from the optimizer step (the same noise in a run and its resume); once per step."""
        if getattr(self, "_step", None) == int(step):
            return
        self._step = int(step)
        for gen in self._generators.values():
            gen.manual_seed(_SEED + self._step)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(_SEED + getattr(self, "_step", 0))
            self._generators[device] = gen
        return self._generators[device]

    def store_(self, dst: Tensor, src: Tensor) -> None:
        """``dst.copy_(src)``, rounding stochastically when ``dst`` is bf16 and ``src`` fp32."""
        if dst.dtype == torch.bfloat16 and src.dtype == torch.float32:
            dst.copy_(stochastic_round(src, self._generator(src.device)))
        else:
            dst.copy_(src)


def stochastic_round(src: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """fp32 -> bf16, rounding to one of the two neighbouring bf16 values with probability by distance.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits of the
    bit pattern and truncating them carries into the kept bits with exactly that probability (on the
    magnitude, so negative values round symmetrically). The truncated value is a bf16 value, so the
    final cast is exact.
    """
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


__all__ = ["DTYPES", "StateRounding", "state_dtype", "stochastic_round"]
