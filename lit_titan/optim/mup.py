"""muP's per-layer learning rates (``model.mup=true``): which parameters are hidden matrices, and their lr.

With the width multiplier m = model.dim / model.mup_base_width (the model's half of muP, initialisation
and the logit and attention multipliers, is in the family's model):

- AdamW: hidden matrices (attention and feed-forward weights: both dimensions grow with width) at
  lr / m; the embedding, the output head (whose logits the model divides by m) and the norm weights at
  lr. The muP paper's Table 3 (Yang et al. 2022, "Tensor Programs V"), Adam column, in the multiplier
  form of its ``mup`` package (``MuAdam``, ``MuReadout``).
- Muon: its matrices at lr * m^-1/2. The orthogonalised update has spectral norm 1 and Moonlight's
  factor 0.2 sqrt(max(fan_out, fan_in)) grows as sqrt(m); the spectral condition for feature learning
  (Yang, Simon & Bernstein 2023: ||dW|| ~ sqrt(fan_out / fan_in), constant as both fans grow) asks for
  a width-independent spectral norm, which m^-1/2 restores (it is Jordan's original scale,
  sqrt(max(1, fan_out / fan_in)), times a constant). Muon's AdamW half follows AdamW's rule (lr).

Weight decay is applied as ``lr * weight_decay`` by both optimizers, so it scales with each group's lr.
The multiplier is a group's ``lr``: the schedule (``LambdaLR`` scales each group's own initial lr),
checkpoints and FSDP/TP (which shard parameters, not groups) keep it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# lr multiplier of a hidden matrix as a power of the width multiplier m, per optimizer
LR_EXPONENT = {"adamw": -1.0, "muon": -0.5}


def width_multiplier(model: nn.Module) -> float | None:
    """m = dim / mup_base_width when the model was built with ``model.mup=true``, else None."""
    args = getattr(model, "args", None)
    if not getattr(args, "mup", False):
        return None
    return args.width_multiplier


def hidden_matrices(model: nn.Module) -> set[int]:
    """ids of the hidden matrices: every parameter with >= 2 dims but those of embeddings and the output head.

    Both muP (lr / m) and Muon (orthogonalised) treat exactly these differently; a 3-D stack of MoE
    experts counts as a batch of matrices.
    """
    from lit_titan.models.llama3.model import OutputHead  # the LM head of every family

    ends: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding | OutputHead):
            ends.update(id(p) for p in module.parameters(recurse=False))
    return {id(p) for p in model.parameters() if p.ndim >= 2 and id(p) not in ends}


def hidden_lr_multiplier(optimizer: str, m: float) -> float:
    """The factor on a hidden matrix's lr under ``optim=optimizer`` at width multiplier ``m``."""
    if optimizer not in LR_EXPONENT:
        raise ValueError(f"model.mup=true has no lr rule for optim={optimizer}; use optim=adamw or optim=muon")
    return m ** LR_EXPONENT[optimizer]


def apply_mup_lr(groups: list[dict[str, Any]], model: nn.Module, optimizer: str, lr: float) -> list[dict[str, Any]]:
    """``groups`` with every hidden matrix moved to a group of its own at muP's lr (unchanged without muP)."""
    m = width_multiplier(model)
    if m is None:
        return groups
    hidden, scaled = hidden_matrices(model), lr * hidden_lr_multiplier(optimizer, m)
    out = []
    for group in groups:
        inner = [p for p in group["params"] if id(p) in hidden]
        outer = [p for p in group["params"] if id(p) not in hidden]
        if inner:
            out.append({**group, "params": inner, "lr": scaled})
        if outer:
            out.append({**group, "params": outer})
    return out


__all__ = ["LR_EXPONENT", "apply_mup_lr", "hidden_lr_multiplier", "hidden_matrices", "width_multiplier"]
