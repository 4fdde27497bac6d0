"""Closed forms of expert parallelism for the planner: routed-expert sizes, the all-to-all, load imbalance.

Written from the layer's arguments (``models/moe.py``'s ``MoEArgs`` under ``args.moe`` and the family's
``is_moe(layer)``), so any MoE family the registry holds is planned the same way; a dense model has no
MoE layer and every term here is 0. docs/planner.md ("Mixture-of-Experts") spells the formulas out.

Expert parallel (``parallel.ep``) shards the routed experts over ``ep`` ranks borrowed from
``dp_shard x cp`` and FSDP-shards them over ``efsdp = dp_shard x cp / ep``: per rank that is the same
``1 / (dp_shard x cp)`` of the experts as without EP, but an expert FSDP unit gathers only over
``efsdp`` (``1 / ep`` of a layer's experts), and every MoE layer pays two all-to-alls (dispatch and
combine) forward and two backward: each rank sends ``tokens x top_k x dim`` activations, of which
``(ep - 1) / ep`` leave the rank.
"""

from __future__ import annotations

# all-to-alls per MoE layer and micro-batch: dispatch + combine forward, their gradients backward
A2A_PER_LAYER = 4
# full activation checkpointing runs the forward's dispatch and combine again inside backward
A2A_RECOMPUTED = 2


def moe_layers(args, layers: range | None = None) -> list[int]:
    """Indices of the MoE layers among ``layers`` (all by default); [] for a dense model."""
    is_moe = getattr(args, "is_moe", None)
    if getattr(args, "moe", None) is None or is_moe is None:
        return []
    return [k for k in (layers if layers is not None else range(args.n_layers)) if is_moe(k)]


def routed_expert_numel(args, layer: int) -> int:
    """Elements of block ``layer``'s routed experts (``w1``, ``w2``, ``w3`` of [E, ...]): what EP shards."""
    if layer not in moe_layers(args, range(layer, layer + 1)):
        return 0
    return args.moe.num_experts * 3 * args.dim * args.moe.hidden_dim


def expert_flops_per_token(args) -> float:
    """Training FLOPs per token of the routed experts (6 x active expert parameters), the part a load
    imbalance stretches on the most loaded expert-parallel rank."""
    m = getattr(args, "moe", None)
    return 6.0 * len(moe_layers(args)) * m.top_k * 3 * args.dim * m.hidden_dim if m is not None else 0.0


def rank_imbalance(expert_imbalance: float, ep: int) -> float:
    """Max/mean load of the expert-parallel ranks from max/mean tokens per expert.

    Without EP every rank computes its own tokens' experts: no rank waits for another (1.0). With EP the
    rank holding the hottest expert is assumed as loaded as that expert relative to the mean (an upper
    bound when hot experts spread over ranks), never more than all tokens on one rank (``ep``).
    """
    return 1.0 if ep <= 1 else min(max(float(expert_imbalance), 1.0), float(ep))


def all_to_all_bytes(args, *, tokens: float, ep: int, expert_imbalance: float = 1.0, elem: int = 2) -> float:
    """Bytes one rank sends (= receives) in ONE all-to-all of one MoE layer: ``tokens`` (this rank's
    tokens in the micro-batch or step) x top_k x dim x ``elem`` bytes x (ep - 1) / ep, times the rank
    imbalance (the most loaded rank receives that much more than the mean)."""
    if ep <= 1 or getattr(args, "moe", None) is None:
        return 0.0
    return tokens * args.moe.top_k * args.dim * elem * (ep - 1) / ep * rank_imbalance(expert_imbalance, ep)


def routed_activation_bytes_per_token(args) -> float:
    """16-bit bytes per token per block, averaged over the blocks, that an MoE layer keeps for backward on top
    of the SwiGLU terms the dense formula counts at ``ffn_hidden_dim`` (top_k experts' width): the tokens
    copied in expert order (the grouped GEMMs' input, or the all-to-all's received buffer under EP) and the
    experts' outputs before the routing weights scale them, top_k x dim each (2 x 2 bytes), and the router's
    fp32 logits and scores (2 x 4 bytes x num_experts). Counted from ``models/moe.py``'s forward, not measured.
    """
    m = getattr(args, "moe", None)
    if m is None:
        return 0.0
    per_layer = 2 * 2 * m.top_k * args.dim + 2 * 4 * m.num_experts
    return per_layer * len(moe_layers(args)) / args.n_layers
