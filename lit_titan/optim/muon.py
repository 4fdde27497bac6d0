"""Muon (Jordan et al. 2024; the AdamW-matched scaling of Moonlight, Liu et al. 2025), exact under sharding.

Muon updates each hidden weight matrix with its momentum orthogonalised by a Newton-Schulz iteration:
every singular value of the update is pushed towards 1. Embeddings, the output head and every
parameter with fewer than two dimensions (norms, biases) stay on AdamW, as the method prescribes. Per
matrix ``W`` (m x n) with gradient ``G``::

    B = mu B + G;  M = G + mu B (Nesterov) or B
    O = NS5(M)                           (quintic Newton-Schulz, ``ns_steps`` iterations, fp32)
    W *= 1 - lr * wd;  W -= lr * 0.2 * sqrt(max(m, n)) * O

``0.2 * sqrt(max(m, n))`` gives the update the RMS of a typical AdamW update (Moonlight), so one
``optim.lr`` and weight decay serve both halves. A parameter with more than two dimensions (stacked
MoE experts) is a batch of matrices over its last two.

Sharding: the update is a function of the *whole* matrix (orthogonalising each FSDP or TP shard
trains a different model). Each rank gathers the whole momentum-corrected matrix
(``full_tensor``), orthogonalises it, and keeps its own shard (``distribute_tensor`` with
``src_data_rank=None``: a local slice, no communication). The alternative, each matrix
orthogonalised once on one rank and scattered back, divides the Newton-Schulz work by the shard
group but needs a balanced assignment of matrices to ranks, a gather to and a scatter from the owner
per matrix, and ranks idle while the owner of the largest matrix computes; gathering everywhere is
one all-gather per matrix and every rank does the same arithmetic (docs/optimizers.md has the cost
at 8B and 70B widths). Pipeline stages hold whole matrices: no gather beyond their own FSDP/TP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lit_titan.optim.adamw import adamw_step_, init_adam_state
from lit_titan.optim.lamb import _like_param, _local, check_betas
from lit_titan.optim.low_precision import StateRounding

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al.: the quintic's a, b, c


def newton_schulz(g: Tensor, steps: int) -> Tensor:
    """The orthogonalisation of ``g`` (a matrix, or a batch over its last two dims), in fp32 (fp64 for fp64)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.promote_types(g.dtype, torch.float32))
    wide = x.size(-2) > x.size(-1)
    if wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if wide else x


def update_scale(shape: torch.Size) -> float:
    """Moonlight's factor matching AdamW's update RMS: 0.2 * sqrt(max(m, n))."""
    return 0.2 * max(shape[-2], shape[-1]) ** 0.5


def _whole(t: Tensor, like: Tensor) -> Tensor:
    """The whole matrix of ``t``, a local piece split like the parameter ``like`` (gathered when sharded)."""
    spec = getattr(like, "_spec", None)
    if spec is None:
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, spec.mesh, spec.placements, shape=like.shape, stride=like.stride()).full_tensor()


def _own_piece(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's piece of ``whole`` in the layout of ``like`` (a slice, no communication)."""
    spec = getattr(like, "_spec", None)
    if spec is None:
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, spec.mesh, spec.placements, src_data_rank=None).to_local()


def orthogonalised_update(momentum: Tensor, like: Tensor, steps: int) -> Tensor:
    """This rank's piece of NS5(whole matrix) scaled to AdamW's RMS; ``momentum`` is a local piece of ``like``."""
    whole = newton_schulz(_whole(momentum, like), steps)
    return _own_piece(whole * update_scale(like.shape), like)


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Muon: every parameter with >= 2 dims but those of embeddings and the output head; AdamW: the rest.

    Norm weights and biases get no weight decay (as under optim=adamw); the embedding and head do.
    """
    from lit_titan.optim.mup import hidden_matrices

    hidden = hidden_matrices(model)
    muon, adam_decay, adam_no_decay, seen = [], [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2:
            adam_no_decay.append(p)
        elif id(p) in hidden:
            muon.append(p)
        else:
            adam_decay.append(p)
    groups = [
        {"params": muon, "use_muon": True, "weight_decay": weight_decay},
        {"params": adam_decay, "use_muon": False, "weight_decay": weight_decay},
        {"params": adam_no_decay, "use_muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# the layer groups whose update RMS a step measures (``Muon.measure_update_rms``)
UPDATE_GROUPS = ("hidden", "embedding_head", "norms")


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon=True``, AdamW (same lr schedule) on the others.

    ``state_dtype``: the dtype of Muon's momentum and AdamW's moments (None: the parameter's; bf16:
    stochastic rounding).

    Set ``measure_update_rms = True`` before a step (the module does on logging steps) and the step
    fills ``update_rms``: per layer group (``UPDATE_GROUPS``: Muon's hidden matrices, AdamW's embedding
    and head, the norms) the RMS of the update per unit lr, weight decay aside: Moonlight's scaling
    makes the first ~0.2, AdamW's typical value, which the run report shows. Sums over this rank's
    pieces of sharded parameters (no communication: FSDP/TP shards are alike, so rank 0's figure
    stands for the whole). One extra reduction per parameter on those steps only.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        betas = check_betas(betas)
        if not 0 <= momentum < 1 or ns_steps < 1:
            raise ValueError(f"Muon needs momentum in [0, 1) and ns_steps >= 1 (got {momentum}, {ns_steps})")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            use_muon=False,
        )
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self._rounding = StateRounding()
        self.measure_update_rms = False
        self.update_rms: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first, measure = True, self.measure_update_rms
        sums: dict[str, list] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    if not state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype)
                else:
                    init_adam_state(state, p, self.state_dtype)
                if first:  # the step count every parameter shares (restored by a resume)
                    self._rounding.start_step(int(state["step"]))
                    first = False
                if group["use_muon"]:
                    sumsq = self._muon_step(p, state, group, measure)
                else:
                    sumsq = adamw_step_(p, state, group, self._rounding, measure)
                if measure:
                    label = "hidden" if group["use_muon"] else "norms" if p.ndim < 2 else "embedding_head"
                    total = sums.setdefault(label, [0.0, 0])
                    total[0], total[1] = total[0] + sumsq, total[1] + _local(p).numel()
        if measure:
            self.update_rms = {k: (sq / max(n, 1)).sqrt() for k, (sq, n) in sums.items()}
            self.measure_update_rms = False
        return loss

    def _muon_step(self, p: Tensor, state: dict[str, Any], group: dict[str, Any], measure: bool) -> Tensor | None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        state["step"] += 1
        compute = torch.promote_types(p.dtype, torch.float32)  # fp32 arithmetic, fp64 under precision=64-true
        w, g = _local(p), _local(_like_param(p.grad, p)).to(compute)
        stored = _local(state["momentum_buffer"])
        buf = stored.to(compute).mul_(mu).add_(g)
        self._rounding.store_(stored, buf, p)
        m = g.add(buf, alpha=mu) if group["nesterov"] else buf
        update = orthogonalised_update(m, p, group["ns_steps"])
        if wd != 0:
            w.mul_(1 - lr * wd)
        w.add_(update.to(w.dtype), alpha=-lr)
        return update.float().square().sum() if measure else None


__all__ = [
    "NS_COEFFICIENTS",
    "UPDATE_GROUPS",
    "Muon",
    "muon_param_groups",
    "newton_schulz",
    "orthogonalised_update",
    "update_scale",
]
