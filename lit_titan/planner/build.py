"""Apply the training parallelisation (``TitanStrategy.parallelize``) to a meta-device model over a
fake process group, and read the per-rank layout off the resulting sharded tensors.

No accelerator, no real communication: torch's ``fake`` backend (``FakeStore``) answers every
collective locally, so a 512-rank mesh can be built in one CPU process. Rank 0's view is built.
The mesh comes from ``TitanStrategy.init_layout``, which training's ``setup_environment`` calls too.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_titan.strategies.parallel_dims import ParallelDims


@contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """A ``fake`` default process group of ``world_size`` ranks for the duration of the block."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("the planner needs its own (fake) process group; run it outside a distributed job")
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class ShardedLayout:
    """What rank 0 holds after ``TitanStrategy.parallelize``."""

    params_total: int  # whole model, before any split
    local_numel: int  # this rank's parameter elements (DTensor.to_local() shapes)
    local_param_bytes: int  # at the dtype the sharded (master) parameters are stored in
    param_dtype: torch.dtype
    fsdp_applied: bool
    layers_on_rank: int  # transformer blocks held by this rank (all its pipeline stages)
    stage_ids: list[int]
    num_stages: int
    unsharded_bf16_bytes: int  # this rank's parameters all-gathered over dp_shard*cp (not tp), in bf16
    largest_unit_numel: int  # largest FSDP unit, gathered over dp_shard*cp (per tp rank)
    examples: dict[str, dict[str, Any]] = field(default_factory=dict)  # a few parameters' shapes/placements
    # pipeline ranks: parameter elements per pp rank (whole stages, before FSDP/TP) and blocks per pp rank
    pp_rank_numel: list[int] = field(default_factory=list)
    pp_rank_layers: list[int] = field(default_factory=list)
    pp_rank_has_output: list[bool] = field(default_factory=list)
    ac_mode: str = "none"
    ac_every_n_layers: int = 2
    float8_layers: int = 0
    compiled: bool = False
    expert_numel: int = 0  # of local_numel, the routed experts' (expert parallel shards them; planner/moe.py)
    # of local_numel, the elements of hidden matrices (optim/mup.py's hidden_matrices: Muon's, one state each)
    local_matrix_numel: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def request_transforms(strategy, callbacks: list) -> dict[str, Any]:
    """Ask ``strategy`` for the transforms the configured callbacks ask for in training (strategies/transforms.py).

    The same plain functions the callbacks' ``setup`` calls, on the strategy directly: no Trainer.
    Float8's hardware check is left out: the plan targets the profile's GPUs, not this machine.
    """
    from lit_titan.callbacks import ActivationCheckpointing, Compile, Float8
    from lit_titan.strategies.transforms import request_activation_checkpointing, request_compile, request_float8

    info: dict[str, Any] = {"ac_mode": "none", "ac_every_n_layers": 2, "float8": None, "compiled": False}
    for cb in callbacks:
        if isinstance(cb, ActivationCheckpointing):
            request_activation_checkpointing(strategy, cb.mode, cb.every_n_layers)
            info["ac_mode"], info["ac_every_n_layers"] = cb.mode, cb.every_n_layers
        elif isinstance(cb, Compile):
            request_compile(strategy, fullgraph=cb.fullgraph, backend=cb.backend, mode=cb.mode)
            info["compiled"] = True
        elif isinstance(cb, Float8):
            request_float8(strategy, cb.convert, cb.tp_style if cb.float8_tp else None)
            info["float8"] = cb
    return info


def build_layout(cfg, model_args, dims: ParallelDims, callbacks: list) -> ShardedLayout:
    """Meta model -> ``TitanStrategy.parallelize`` over a fake PG of ``dims.world_size`` ranks (rank 0)."""
    from lit_titan.job.build import build_strategy
    from lit_titan.models.registry import build_model
    from lit_titan.strategies.pipeline import split_units, stage_ids

    strategy = build_strategy(cfg)  # the same constructor call as a training run
    with fake_process_group(dims.world_size):
        strategy.init_layout(dims, "cpu")  # what setup_environment does after its process group exists
        info = request_transforms(strategy, callbacks)

        with torch.device("meta"):
            model = build_model(model_args)
        params_total = sum(p.numel() for p in model.parameters())
        plan = strategy.plan_for(model)

        # Per pipeline rank (analytic, from the same split functions the strategy uses).
        if dims.pp > 1:
            cfgp = strategy.pipeline_config
            n_stages = dims.pp * cfgp.per_rank
            units = plan.pipeline_units(model)
            names = split_units(units, n_stages, cfgp.stages)
            numel = {n: sum(p.numel() for p in model.get_submodule(n).parameters()) for u in units for n in u}
            pp_numel, pp_layers, pp_out = [], [], []
            for r in range(dims.pp):
                mods = [n for s in stage_ids(r, dims.pp, cfgp) for n in names[s]]
                pp_numel.append(sum(numel[n] for n in mods))
                pp_layers.append(sum(n.startswith("layers.") for n in mods))
                pp_out.append("output" in mods)
        else:
            pp_numel, pp_layers, pp_out = [params_total], [model_args.n_layers], [True]

        rank_model, views = strategy.parallelize(model, str(cfg.precision))

        from lit_titan.optim.mup import hidden_matrices

        local_numel, local_bytes, dtype = 0, 0, torch.float32
        hidden = hidden_matrices(rank_model)
        local_matrix_numel = sum(_local(p).numel() for p in rank_model.parameters() if id(p) in hidden)
        examples: dict[str, dict[str, Any]] = {}  # the first embedding, wq and w2 that rank 0 holds
        kinds = ["tok_embeddings.weight", "attention.wq.weight", "feed_forward.w2.weight"]
        for name, p in rank_model.named_parameters():
            loc = _local(p)
            local_numel += loc.numel()
            local_bytes += loc.numel() * loc.element_size()
            dtype = loc.dtype
            kind = next((k for k in kinds if name.endswith(k)), None)
            if kind is not None:
                kinds.remove(kind)
                examples[name] = {
                    "global_shape": list(p.shape),
                    "local_shape": list(loc.shape),
                    "placements": [str(pl) for pl in getattr(p, "placements", ())],
                }
        # Routed experts (expert parallel shards them; an FSDP unit of their own, gathered over efsdp).
        from lit_titan.models.moe import GroupedExperts

        expert_ids = {id(p) for m in rank_model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        expert_numel = sum(_local(p).numel() for p in rank_model.parameters() if id(p) in expert_ids)
        # FSDP units and their all-gathered size (over dp_shard*cp; still TP-sharded), bf16.
        fsdp = dims.fsdp_size
        largest = 0
        for view in views:
            for unit in plan.fsdp_units(view):
                mods = unit if isinstance(unit, list) else [unit]
                params = [p for m in mods for p in m.parameters()]
                routed = sum(_local(p).numel() for p in params if id(p) in expert_ids) if dims.ep > 1 else 0
                n = sum(_local(p).numel() for p in params) - routed
                largest = max(largest, n * fsdp, routed * dims.efsdp)
        layers = len(list(plan.blocks(rank_model)))  # under PP: the union of this rank's stages
        f8 = info["float8"]
        return ShardedLayout(
            params_total=params_total,
            local_numel=local_numel,
            local_param_bytes=local_bytes,
            param_dtype=dtype,
            fsdp_applied=strategy.fsdp_applied,
            layers_on_rank=layers,
            stage_ids=list(strategy.stage_ids),
            num_stages=strategy.num_stages,
            unsharded_bf16_bytes=local_numel * fsdp * 2,
            largest_unit_numel=largest,
            examples=examples,
            pp_rank_numel=pp_numel,
            pp_rank_layers=pp_layers,
            pp_rank_has_output=pp_out,
            ac_mode=info["ac_mode"],
            ac_every_n_layers=info["ac_every_n_layers"],
            float8_layers=len(f8.converted) if f8 is not None else 0,
            compiled=info["compiled"],
            expert_numel=expert_numel,
            local_matrix_numel=local_matrix_numel,
        )
