"""The optimizer's state memory per rank: how many state tensors each parameter has, at what element size.

AdamW and LAMB keep two moments per parameter; Muon keeps one momentum buffer per hidden matrix (the
parameters ``optim.mup.hidden_matrices`` names: attention and feed-forward weights, experts) and AdamW's
two moments for the rest (embedding, head, norms). ``optim.state_dtype=bf16`` stores them at 2 bytes
per element; fp32 means the parameters' own dtype (2 bytes under ``precision=bf16-true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimizerStates:
    name: str = "adamw"
    elem_bytes: int | None = None  # None: the parameters' own

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
        name=str(optim.get("name", "adamw")), elem_bytes=2 if optim.get("state_dtype") == "bf16" else None
    )
