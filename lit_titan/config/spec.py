"""``JobSpec``: the composed config checked once and turned into what the library needs.

``validate(cfg)`` is the one place a config is checked (schema, then ``rules``) and the one place
where the model's arguments, the resolved degrees, the batch layout and the pipeline settings are
worked out; everything downstream (the run builders, the planner) reads the ``JobSpec`` instead of
re-deriving them from ``cfg``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.config import rules
from lit_titan.config.schema_check import check_schema
from lit_titan.errors import ConfigError, keyed_line

# The model and strategy modules import torch and Lightning (seconds): imported where a config is
# validated, so `--help` and the Hydra app's own displays stay fast.
if TYPE_CHECKING:
    from lit_titan.data.batch_layout import BatchLayout
    from lit_titan.models.registry import ModelArgsLike as ModelArgs
    from lit_titan.strategies.parallel_dims import ParallelDims
    from lit_titan.strategies.pipeline import PipelineConfig

world_size = rules.world_size


@dataclass(frozen=True)
class JobSpec:
    """A checked job: the model's arguments, the degrees resolved over the world, how the global batch
    splits, and the pipeline settings (None without pipeline parallelism)."""

    model: ModelArgs
    dims: ParallelDims
    batch: BatchLayout
    pipeline: PipelineConfig | None
    seq_len: int
    precision: str


def validate(cfg: DictConfig, *, schema_checked: bool = False) -> JobSpec:
    """Every check that needs no data, model weights or processes; raises ConfigError/LayoutError.

    First the schema (``schema.py``: types, unknown keys, ranges, choices), then the rules that tie
    keys together (``rules.py``). The same config gives the same answer on every rank, so such an
    error is marked ``raised_on_every_rank``: under a launcher only the first rank prints it.
    ``schema_checked``: ``cfg`` came from ``compose(check=True)``, so the schema is not checked again.
    """
    try:
        if not schema_checked:
            check_schema(cfg)
        return _build(cfg)
    except ValueError as err:  # ConfigError and LayoutError are ValueErrors
        err.args = (keyed_line(str(err)),)
        err.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise


def _build(cfg: DictConfig) -> JobSpec:
    try:
        args = model_args(cfg)
    except ValueError as err:  # the model's own argument checks (models/llama3/args.py)
        text = str(err)
        raise ConfigError(
            text
            if "; " in text
            else f"{text}; change the model.* keys named (conf/model/{cfg.model.name}.yaml has the flavor's)"
        ) from err
    rules.targets(cfg)
    for rule in rules.MODEL_RULES:
        rule(cfg, args)
    for config_rule in rules.CONFIG_RULES:
        config_rule(cfg)
    dims = parallel_dims(cfg)
    for layout_rule in rules.LAYOUT_RULES:
        layout_rule(cfg, args, dims)
    batch = batch_layout(cfg, dims)
    pipeline = None
    if dims.pp > 1:
        pipeline = pipeline_config(cfg)
        pipeline.validate(pp=dims.pp, n_units=args.n_layers + 2, local_batch=batch.micro)
    return JobSpec(
        model=args,
        dims=dims,
        batch=batch,
        pipeline=pipeline,
        seq_len=int(cfg.data.seq_len),
        precision=str(cfg.precision),
    )


# ---- the pieces of a JobSpec, each from the config's keys (also what the planner's search calls) ---------
def model_args(cfg: DictConfig) -> ModelArgs:
    from lit_titan.models.registry import model_args as flavor_args

    return flavor_args(cfg.model.name, **model_overrides(cfg))


def model_overrides(cfg: DictConfig) -> dict[str, Any]:
    from lit_titan.models.registry import spec_for

    spec = spec_for(cfg.model.name)
    model = OmegaConf.to_container(cfg.model, resolve=True)  # plain dicts/lists (nested groups: model.moe)
    out = {k: model[k] for k in spec.arg_keys if k not in spec.nullable_keys and model.get(k) is not None}
    out.update({k: model[k] for k in spec.nullable_keys if k in model})
    return out


def parallel_dims(cfg: DictConfig) -> ParallelDims:
    from lit_titan.strategies.parallel_dims import ParallelDims

    p = cfg.parallel
    return ParallelDims.resolve(
        world_size(cfg), pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, ep=p.get("ep", 1)
    )


def batch_layout(cfg: DictConfig, dims: ParallelDims, *, check: bool = True) -> BatchLayout:
    from lit_titan.data.batch_layout import BatchLayout

    return BatchLayout.derive(int(cfg.data.global_batch_size), cfg.data.micro_batch_size, dims.dp, check=check)


def pipeline_config(cfg: DictConfig) -> PipelineConfig:
    from lit_titan.strategies.pipeline import PipelineConfig

    p = cfg.parallel
    stages = p.get("pp_stages")
    return PipelineConfig(
        schedule=p.pp_schedule,
        microbatches=p.pp_microbatches,
        stages_per_rank=p.get("pp_stages_per_rank"),
        stages=tuple(tuple(s) for s in stages) if stages else None,
    )
