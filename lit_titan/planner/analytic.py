"""Rank 0's layout in closed form: what ``build.build_layout`` measures, without building anything.

The search evaluates tens of thousands of candidate layouts; building each on a meta model over a
fake process group takes seconds (405B: ~1.3 s), so it counts parameters per module from the model
arguments instead and splits them the way ``TitanStrategy.parallelize`` does: pipeline stages by
``strategies.pipeline.split_units`` / ``stage_ids`` (the same functions), TP over every weight but
the RMSNorm weights (sequence parallel keeps them replicated), FSDP over ``dp_shard * cp``. The top
candidates are then confirmed with the real build (``search.confirm``), and
``tests/unit/planner/test_plan.py::test_analytic_layout_matches_the_meta_build`` pins the two together.
"""

from __future__ import annotations

import functools

from lit_titan.planner.build import ShardedLayout
from lit_titan.planner.moe import routed_expert_numel
from lit_titan.strategies.parallel_dims import ParallelDims
from lit_titan.strategies.pipeline import PipelineConfig, split_units, stage_ids


def module_numel(args) -> dict[str, tuple[int, int]]:
    """Per pipeline module: (elements TP shards, elements TP keeps whole); blocks from the model family
    (``registry.layer_numel``: an MoE layer counts every expert, the memory it holds)."""
    from lit_titan.models.registry import layer_numel

    h, v = args.dim, args.vocab_size
    out = {"tok_embeddings": (v * h, 0), "norm": (0, h), "output": (v * h, 0)}
    for k in range(args.n_layers):
        out[f"layers.{k}"] = layer_numel(args, k)
    return out


@functools.lru_cache(maxsize=8)
def block_vector_numel(args) -> int:
    """A block's elements in parameters of fewer than two dims (norm weights), from a one-block meta build
    (no family declares them; every block of a family has the same norms, MoE or dense)."""
    import dataclasses

    import torch

    from lit_titan.models.registry import build_model

    with torch.device("meta"):
        model = build_model(dataclasses.replace(args, n_layers=1))
    return sum(p.numel() for p in model.layers["0"].parameters() if p.ndim < 2)


def analytic_layout(
    args,
    dims: ParallelDims,
    pipeline: PipelineConfig | None,
    *,
    precision: str,
    ac_mode: str = "none",
    ac_every_n_layers: int = 2,
    float8: bool = False,
) -> ShardedLayout:
    """A :class:`ShardedLayout` for rank 0 (pp rank 0) from the model arguments alone."""
    numel = module_numel(args)
    units = [["tok_embeddings"], *[[f"layers.{k}"] for k in range(args.n_layers)], ["norm", "output"]]
    if dims.pp > 1:
        assert pipeline is not None
        n_stages = dims.pp * pipeline.per_rank
        names = split_units(units, n_stages, pipeline.stages)
        per_rank_mods = [[n for s in stage_ids(r, dims.pp, pipeline) for n in names[s]] for r in range(dims.pp)]
        stages0 = stage_ids(0, dims.pp, pipeline)
    else:
        per_rank_mods, n_stages, stages0 = [[n for u in units for n in u]], 1, [0]
    t, fsdp = dims.tp, dims.fsdp_size

    experts = {m: routed_expert_numel(args, int(m.split(".")[1])) for m in numel if m.startswith("layers.")}

    def local_experts(m: str) -> int:
        # FSDP shards dim 0 (this rank's num_experts / ep experts) over efsdp in chunks of ceil(rows / efsdp):
        # with more ranks than experts rank 0 holds a whole expert, more than the mean.
        if not experts.get(m):
            return 0
        rows = args.moe.num_experts // dims.ep
        return -(-rows // dims.efsdp) * (experts[m] // args.moe.num_experts)

    def local(mods: list[str]) -> int:
        return sum(
            -(-numel[m][0] // (t * fsdp)) + -(-(numel[m][1] - experts.get(m, 0)) // fsdp) + local_experts(m)
            for m in mods
        )

    mods0 = per_rank_mods[0]
    local_numel = local(mods0)
    # a block's hidden matrices (Muon's, one state each): all but its vectors (norms: TP keeps them whole)
    vectors = block_vector_numel(args)
    elem = 2 if precision == "bf16-true" else 4
    # FSDP units: each block, the embedding, [norm, output]; gathered over dp_shard*cp, per tp rank.
    # With ep > 1 a block's routed experts are a unit of their own, gathered over efsdp: 1/ep of them.
    split = dims.ep > 1
    # Experts as FSDP gathers them: rank 0's chunk (padded when there are more ranks than experts) x the group.
    unit_sizes = []
    for u in units:
        if all(m in mods0 for m in u):
            rest = sum(numel[m][0] // t + numel[m][1] - experts.get(m, 0) for m in u)
            gathered = sum(local_experts(m) for m in u) * (dims.efsdp if split else fsdp)
            unit_sizes += [rest, gathered] if split else [rest + gathered]
    sharded = dims.dp_replicate * fsdp > 1 or precision == "bf16-mixed"
    return ShardedLayout(
        params_total=sum(a + b for a, b in numel.values()),
        local_numel=local_numel,
        local_param_bytes=local_numel * elem,
        param_dtype=_dtype(elem),
        fsdp_applied=sharded,
        layers_on_rank=sum(m.startswith("layers.") for m in mods0),
        stage_ids=stages0,
        num_stages=n_stages,
        unsharded_bf16_bytes=local_numel * fsdp * 2,
        largest_unit_numel=max(unit_sizes, default=0),
        pp_rank_numel=[sum(sum(numel[m]) for m in mods) for mods in per_rank_mods],
        pp_rank_layers=[sum(m.startswith("layers.") for m in mods) for mods in per_rank_mods],
        pp_rank_has_output=["output" in mods for mods in per_rank_mods],
        ac_mode=ac_mode,
        ac_every_n_layers=ac_every_n_layers,
        float8_layers=int(float8) * args.n_layers * 7,
        compiled=False,
        expert_numel=sum(local_experts(m) for m in mods0),
        local_matrix_numel=sum(local([m]) - -(-vectors // fsdp) for m in mods0 if m.startswith("layers.")),
    )


def _dtype(elem: int):
    import torch

    return torch.bfloat16 if elem == 2 else torch.float32
