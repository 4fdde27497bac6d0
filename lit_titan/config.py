"""Compose the Hydra config from ``conf/`` and check it before any expensive work."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.errors import ConfigError
from lit_titan.loss import resolve_chunk_tokens
from lit_titan.models.llama3 import ModelArgs, get_flavor
from lit_titan.strategies.parallel_dims import LayoutError, ParallelDims
from lit_titan.strategies.pipeline import V_SHAPED, PipelineConfig

LOGGERS = ("csv", "tensorboard", "wandb")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
MODEL_ARG_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of",
                  "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings", "attention")
# Keys whose null is a value (no rotary scaling), not "the flavor's default": passed whenever present.
MODEL_NULLABLE_KEYS = ("rope_scaling",)


def conf_dir() -> Path:
    """``conf/`` of the repository, or of the installed wheel (package ``lit_titan.conf``)."""
    return Path(str(importlib.resources.files("lit_titan.conf")))


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        detail = str(err).strip() or str(err.__cause__ or "").strip() or type(err).__name__
        raise ConfigError(f"{detail}\n(config groups and their options: {conf_dir()})") from err


def model_args(cfg: DictConfig) -> ModelArgs:
    return get_flavor(cfg.model.name, **model_overrides(cfg))


def model_overrides(cfg: DictConfig) -> dict[str, Any]:
    out = {k: cfg.model[k] for k in MODEL_ARG_KEYS if cfg.model.get(k) is not None}
    for k in MODEL_NULLABLE_KEYS:
        if k in cfg.model:
            value = cfg.model[k]
            out[k] = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    return out


def world_size(cfg: DictConfig) -> int:
    return int(cfg.cluster.devices) * int(cfg.cluster.num_nodes)


def parallel_dims(cfg: DictConfig) -> ParallelDims:
    p = cfg.parallel
    return ParallelDims.resolve(world_size(cfg), pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
                                cp=p.cp, tp=p.tp)


def validate(cfg: DictConfig) -> tuple[ModelArgs, ParallelDims]:
    """Every check that needs no data, model weights or processes; raises ConfigError/LayoutError."""
    try:
        args = model_args(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        resolve_chunk_tokens((cfg.get("loss") or {}).get("chunk_tokens", "auto"), args.vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.logger.name not in LOGGERS:
        raise ConfigError(f"unknown logger {cfg.logger.name!r}; choose logger=<one of {LOGGERS}>")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision!r} is not supported; choose one of {PRECISIONS}")
    seq_len = int(cfg.data.seq_len)
    if seq_len < 1:
        raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
    if seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the maximum sequence length {args.max_seq_len} of "
                          f"{cfg.model.name}; lower data.seq_len or raise model.max_seq_len")
    if cfg.model.get("init_from_hf"):
        from lit_titan.models.llama3.hf import check_hf_dir  # lazy: only runs that start from HF weights

        check_hf_dir(str(cfg.model.init_from_hf), args)  # FileNotFoundError / ConfigError naming the fix
    if int(cfg.trainer.max_steps) < 1:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} must be >= 1")
    _validate_fault(cfg, world_size(cfg))
    dims = parallel_dims(cfg)
    if args.tie_embeddings and dims.pp > 1:
        raise ConfigError(f"model.tie_embeddings=true ({cfg.model.name}) is not supported with parallel.pp={dims.pp}: "
                          f"the embedding (first stage) and the output head (last stage) sit on different ranks, "
                          f"and torch's pipeline schedules do not sum a shared weight's gradients across stages; "
                          f"use parallel.pp=1 (FSDP/TP keep it tied) or model.tie_embeddings=false")
    _validate_grad_reduce_scatter(cfg, dims)
    dims.validate(n_heads=args.n_heads, n_kv_heads=args.kv_heads, seq_len=seq_len,
                  global_batch_size=int(cfg.data.global_batch_size),
                  micro_batch_size=cfg.data.micro_batch_size)
    if cfg.data.get("document_masking") and (dims.pp > 1 or dims.cp > 1):
        raise ConfigError("data.document_masking=true is not supported with parallel.pp > 1 or parallel.cp > 1: "
                          "the pipeline stages and CP's all-gather-KV attention receive no document ids (CP would "
                          "also need the block mask split per chunk); set data.document_masking=false or pp=cp=1")
    if args.attention == "flex" and str(cfg.cluster.get("accelerator", "")) == "cpu":
        raise ConfigError("model.attention=flex cannot train on CPU: torch's flex_attention has no CPU backward "
                          "(torch 2.15); use model.attention=sdpa (document masking then uses a dense mask) "
                          "or a GPU cluster profile")
    if args.attention == "flex" and dims.cp > 1:
        raise ConfigError("model.attention=flex is not supported with parallel.cp > 1 (CP's attention is SDPA); "
                          "set model.attention=sdpa")
    if cfg.data.get("document_positions") and (dims.pp > 1 or dims.cp > 1):
        raise ConfigError("data.document_positions=true is not supported with parallel.pp > 1 or parallel.cp > 1 yet; "
                          "set data.document_positions=false")
    if dims.pp > 1:
        micro = int(cfg.data.micro_batch_size or int(cfg.data.global_batch_size) // dims.dp)
        pipeline_config(cfg).validate(pp=dims.pp, n_units=args.n_layers + 2, local_batch=micro)
        if cfg.parallel.pp_schedule in V_SHAPED and cfg.trainer.limit_val_batches:
            raise LayoutError(f"validation under parallel.pp_schedule={cfg.parallel.pp_schedule} fails in torch's "
                              f"schedule eval (torch 2.14); set trainer.limit_val_batches=0 or use Interleaved1F1B")
    return args, dims


def _validate_fault(cfg: DictConfig, world: int) -> None:
    fault = cfg.get("fault") or {}
    if fault.get("kill_rank") is None:
        return
    if fault.get("at_step") is None:
        raise ConfigError("fault.kill_rank is set but fault.at_step is not; set the optimizer step to fail at")
    if not 0 <= int(fault.kill_rank) < world:
        raise ConfigError(f"fault.kill_rank={fault.kill_rank} is not a rank of this {world}-process job")
    if fault.get("during_save") and not cfg.checkpoint.enabled:
        raise ConfigError("fault.during_save needs checkpoint.enabled=true")


def _validate_grad_reduce_scatter(cfg: DictConfig, dims: ParallelDims) -> None:
    from lit_titan.strategies.fsdp import GRAD_REDUCE_SCATTER, PP_LAST_MICROBATCH

    mode = cfg.parallel.get("grad_reduce_scatter", "every_microbatch")
    if mode not in GRAD_REDUCE_SCATTER:
        raise ConfigError(f"parallel.grad_reduce_scatter={mode!r} is not an option; "
                          f"choose one of {GRAD_REDUCE_SCATTER}")
    if mode == "last_microbatch" and dims.pp > 1:
        raise ConfigError(PP_LAST_MICROBATCH)


def pipeline_config(cfg: DictConfig) -> PipelineConfig:
    p = cfg.parallel
    stages = p.get("pp_stages")
    return PipelineConfig(schedule=p.pp_schedule, microbatches=p.pp_microbatches,
                          stages_per_rank=p.get("pp_stages_per_rank"),
                          stages=tuple(tuple(s) for s in stages) if stages else None)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
