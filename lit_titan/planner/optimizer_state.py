"""The optimizer's planner terms: state memory per rank, and Muon's orthogonalisation time per step.

AdamW and LAMB keep two moments per parameter; Muon keeps one momentum buffer per hidden matrix (the
parameters ``optim.mup.hidden_matrices`` names: attention and feed-forward weights, experts) and AdamW's
two moments for the rest (embedding, head, norms). ``optim.state_dtype=bf16`` stores them at 2 bytes
per element; fp32 means the parameters' own dtype (2 bytes under ``precision=bf16-true``).

Muon's time is the gathered scheme as ``lit_titan/optim/muon.py`` runs it: every rank all-gathers each
hidden matrix of its pipeline stage whole (fp32, over the ranks FSDP and TP split it on), then runs
``ns_steps`` Newton-Schulz iterations on it in fp32, one matrix after the other (nothing overlaps them).
One iteration on an m x n matrix with s = min(m, n), l = max(m, n) (``newton_schulz`` iterates on the
s x s Gram matrix): ``X X^T`` 2 s^2 l, its square 2 s^3, the product with ``X`` 2 s^2 l FLOPs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

GATHER_ELEM_BYTES = 4  # the momentum-corrected matrix is gathered in fp32 (muon.py: ``.float()`` before it)


@dataclass(frozen=True)
class OptimizerStates:
    name: str = "adamw"
    elem_bytes: int | None = None  # None: the parameters' own
    ns_steps: int = 5  # Muon's Newton-Schulz iterations

    @property
    def label(self) -> str:
        """How a user's config names it (the out-of-memory line names the states it counts)."""
        return {"adamw": "AdamW", "lamb": "LAMB", "muon": "Muon"}.get(self.name, self.name)

    def bytes(self, local_numel: int, local_matrix_numel: int, param_elem: int) -> int:
        """State bytes for ``local_numel`` parameter elements, ``local_matrix_numel`` of them in hidden matrices."""
        elem = self.elem_bytes or param_elem
        if self.name == "muon":
            return (2 * local_numel - local_matrix_numel) * elem
        return 2 * local_numel * elem


def optimizer_states(cfg: Any) -> OptimizerStates:
    """The ``optim`` group of a composed config as the planner counts it."""
    optim = cfg.get("optim") or {}
    return OptimizerStates(
        name=str(optim.get("name", "adamw")),
        elem_bytes=2 if optim.get("state_dtype") == "bf16" else None,
        ns_steps=int(optim.get("ns_steps", 5)),
    )


def newton_schulz_flops(m: int, n: int, steps: int) -> int:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on one m x n matrix: steps x (4 s^2 l + 2 s^3)."""
    s, big = min(m, n), max(m, n)
    return steps * (4 * s * s * big + 2 * s**3)


@functools.lru_cache(maxsize=8)
def hidden_matrices_per_layer(args) -> tuple[tuple[int, int, int], ...]:
    """Per block: (Newton-Schulz FLOPs of one iteration, elements, largest matrix's FLOPs) over the hidden
    matrices Muon orthogonalises, from a meta build (every family; a 3-D expert stack is a batch)."""
    import torch

    from lit_titan.models.registry import build_model

    with torch.device("meta"):
        model = build_model(args)
    out = []
    for k in range(args.n_layers):
        flops = numel = largest = 0
        for p in model.layers[str(k)].parameters():
            if p.ndim < 2:
                continue
            batch = math.prod(p.shape[:-2])
            one = newton_schulz_flops(p.shape[-2], p.shape[-1], 1)
            flops, numel, largest = flops + batch * one, numel + p.numel(), max(largest, one)
        out.append((flops, numel, largest))
    return tuple(out)


def muon_cost(args, *, layers: int, split: int, ns_steps: int) -> dict[str, float]:
    """What one rank does per optimizer step under the gathered scheme: FLOPs, bytes received, matrices.

    ``layers``: the blocks of the rank's pipeline stages (it orthogonalises all of their matrices);
    ``split``: the ranks each matrix is split over (FSDP x TP), whose all-gather brings (split-1)/split of it.
    Averages over the model's blocks (MoE families may mix dense and MoE blocks).
    """
    per_layer = hidden_matrices_per_layer(args)
    scale = layers / max(len(per_layer), 1)
    flops = sum(f for f, _, _ in per_layer) * ns_steps * scale
    numel = sum(n for _, n, _ in per_layer) * scale
    received = (split - 1) / split * numel * GATHER_ELEM_BYTES if split > 1 else 0.0
    return {
        "flops": flops,
        "gather_bytes": received,
        "matrix_numel": numel,
        "largest_matrix_flops": max(big for _, _, big in per_layer) * ns_steps,
    }
