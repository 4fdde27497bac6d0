"""Compose the Hydra config from ``conf/`` and check it before any expensive work."""

from __future__ import annotations

import importlib.resources
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.errors import ConfigError
from lit_titan.schema_check import check_schema, compose_error_line

# The model, strategy and optimizer modules import torch and Lightning (seconds): they are imported
# where a config is validated, so `--help` and the Hydra app's own displays stay fast.
if TYPE_CHECKING:
    from lit_titan.models.registry import ModelArgsLike as ModelArgs
    from lit_titan.strategies.parallel_dims import ParallelDims
    from lit_titan.strategies.pipeline import PipelineConfig

RUN_DIR_ENV = "LIT_TITAN_RUN_DIR"


def conf_dir() -> Path:
    """``conf/`` of the repository, or of the installed wheel (package ``lit_titan.conf``)."""
    return Path(str(importlib.resources.files("lit_titan.conf")))


def default_run_dir(run_dir: str | None, model_name: str) -> str:
    """``run_dir``, else the one the launching process chose (LIT_TITAN_RUN_DIR), else runs/<model>-<stamp>.

    The stamp is torchrun's run id when there is one, so every rank of a torchrun job agrees on it;
    children Lightning starts inherit LIT_TITAN_RUN_DIR from the parent.
    """
    if run_dir:
        return str(run_dir)
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    stamp = os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return str(Path("runs") / f"{model_name}-{stamp}")


def _register_resolvers() -> None:
    """Resolvers conf/train.yaml's ``hydra:`` node uses: Hydra's run/sweep directory *is* ``run_dir``."""
    OmegaConf.register_new_resolver("lit_titan.run_dir", default_run_dir, replace=True, use_cache=True)
    # use_cache: Hydra copies the cache to every sweep point, so all points agree on the stamp.
    OmegaConf.register_new_resolver(
        "lit_titan.sweep_dir", lambda run_dir: str(run_dir) if run_dir else
        str(Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"), replace=True, use_cache=True)


_register_resolvers()


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        detail = " ".join((str(err).strip() or str(err.__cause__ or "").strip() or type(err).__name__).split())
        line = compose_error_line(f"{detail} {err.__cause__ or ''}", list(overrides),
                                  lambda group: sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")))
        error = ConfigError(line or f"{detail}; config groups and their options: {conf_dir()}")
        error.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise error from err
    try:
        check_schema(cfg)  # a wrong type, unknown key or out-of-range value is refused here, at compose time
    except ConfigError as err:
        err.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise
    return cfg


def model_args(cfg: DictConfig) -> ModelArgs:
    from lit_titan.models.registry import model_args as flavor_args

    return flavor_args(cfg.model.name, **model_overrides(cfg))


def model_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The ``model.*`` keys that override the flavor's arguments (its family's argument names); a key
    whose null is a value (no rotary scaling), not "the flavor's default", is passed whenever present."""
    from lit_titan.models.registry import spec_for

    spec = spec_for(cfg.model.name)
    out = {k: cfg.model[k] for k in spec.arg_keys if k not in spec.nullable_keys and cfg.model.get(k) is not None}
    for k in spec.nullable_keys:
        if k in cfg.model:
            value = cfg.model[k]
            out[k] = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    return out


def world_size(cfg: DictConfig) -> int:
    return int(cfg.cluster.devices) * int(cfg.cluster.num_nodes)


def parallel_dims(cfg: DictConfig) -> ParallelDims:
    from lit_titan.strategies.parallel_dims import ParallelDims

    p = cfg.parallel
    return ParallelDims.resolve(world_size(cfg), pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
                                cp=p.cp, tp=p.tp)


def validate(cfg: DictConfig) -> tuple[ModelArgs, ParallelDims]:
    """Every check that needs no data, model weights or processes; raises ConfigError/LayoutError.

    First the schema (lit_titan/schema.py: types, unknown keys, ranges, choices), then the rules that
    tie keys together. The same config gives the same answer on every rank, so such an error is
    marked ``raised_on_every_rank``: under a launcher only the first rank prints it (cli.py).
    """
    try:
        return _validate(cfg)
    except ValueError as err:  # ConfigError and LayoutError are ValueErrors
        err.args = (keyed_line(str(err)),)
        err.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise


_KEYED = re.compile(r"^(?P<kv>[A-Za-z_][\w.\[\]]*=(?:\[[^\]]*\]|\{[^}]*\}|'[^']*'|\S+?))(?P<colon>:?) "
                    r"(?P<rest>.*)$", re.S)


def keyed_line(message: str) -> str:
    """``key=value: what is wrong; what to do``: messages raised deeper down (ParallelDims, the model's
    arguments, the profiler's windows) that start ``key=value must ...`` get the colon of that form."""
    m = _KEYED.match(message)
    return f"{m['kv']}: {m['rest']}" if m and not m["colon"] else message


def _validate(cfg: DictConfig) -> tuple[ModelArgs, ParallelDims]:
    from lit_titan.callbacks.preflight import check_config as check_preflight
    from lit_titan.loss import resolve_chunk_tokens
    from lit_titan.optim import check_optim
    from lit_titan.strategies.parallel_dims import LayoutError
    from lit_titan.strategies.pipeline import V_SHAPED

    check_schema(cfg)
    try:
        args = model_args(cfg)
    except ValueError as err:  # the flavor lookup and the model's own argument checks (models/<family>/args.py)
        text = str(err)
        raise ConfigError(text if "; " in text else f"{text}; change the model.* keys named (conf/model/"
                                                    f"{cfg.model.name}.yaml has the flavor's)") from err
    _validate_targets(cfg)
    try:
        resolve_chunk_tokens((cfg.get("loss") or {}).get("chunk_tokens", "auto"), args.vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    seq_len = int(cfg.data.seq_len)  # types and ranges of single keys: check_schema above
    if seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len}: exceeds the maximum sequence length {args.max_seq_len} of "
                          f"{cfg.model.name}; use data.seq_len<={args.max_seq_len} or raise model.max_seq_len")
    tok = cfg.data.get("tokenizer") or {}
    if tok.get("kind") == "bpe" and tok.get("vocab_size") is not None and int(tok.vocab_size) > args.vocab_size:
        raise ConfigError(f"data.tokenizer.vocab_size={tok.vocab_size}: larger than model.vocab_size="
                          f"{args.vocab_size}, token ids would index past the embedding; use "
                          f"data.tokenizer.vocab_size<={args.vocab_size} or raise model.vocab_size")
    window = getattr(args, "sliding_window", None)  # families without windowed attention lack the key
    if window is not None and window > seq_len:
        raise ConfigError(f"model.sliding_window={window}: exceeds data.seq_len={seq_len} (the window "
                          f"would be the whole sequence); lower model.sliding_window or set it to null for full attention")
    if cfg.model.get("init_from_hf"):
        from lit_titan.models.registry import hf_adapter  # lazy: only runs that start from HF weights

        where = f"model.init_from_hf={cfg.model.init_from_hf}"
        try:
            adapter = hf_adapter(args, where)
        except ValueError as err:
            raise ConfigError(f"{err}; set model.init_from_hf=null") from err
        adapter.check_hf_dir(str(cfg.model.init_from_hf), args)  # FileNotFoundError / ConfigError naming the fix
    try:
        check_optim(str(cfg.optim.get("name", "adamw")), cfg.optim.betas)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    _validate_fault(cfg, world_size(cfg))
    check_preflight(cfg.get("preflight"), cfg.get("fault"), world_size(cfg))
    _validate_profiler(cfg)
    dims = parallel_dims(cfg)
    if args.tie_embeddings and dims.pp > 1:
        raise ConfigError(f"model.tie_embeddings=true: ({cfg.model.name}) not supported with parallel.pp={dims.pp}: "
                          f"the embedding (first stage) and the output head (last stage) sit on different ranks, "
                          f"and torch's pipeline schedules do not sum a shared weight's gradients across stages; "
                          f"use parallel.pp=1 (FSDP/TP keep it tied) or model.tie_embeddings=false")
    _validate_grad_reduce_scatter(cfg, dims)
    dims.validate(n_heads=args.n_heads, n_kv_heads=args.kv_heads, seq_len=seq_len,
                  global_batch_size=int(cfg.data.global_batch_size),
                  micro_batch_size=cfg.data.micro_batch_size)
    if cfg.data.get("document_masking") and dims.cp > 1:
        raise ConfigError("data.document_masking=true: not supported with parallel.cp > 1 (CP's all-gather-KV "
                          "attention receives no document ids and would need the block mask split per chunk); "
                          "set data.document_masking=false or parallel.cp=1")
    if getattr(args, "attention", "sdpa") == "flex" and str(cfg.cluster.get("accelerator", "")) == "cpu":
        raise ConfigError("model.attention=flex: cannot train on CPU, torch's flex_attention has no CPU backward "
                          "(torch 2.15); use model.attention=sdpa (document masking then uses a dense mask) "
                          "or a GPU cluster profile")
    if getattr(args, "attention", "sdpa") == "flex" and dims.cp > 1:
        raise ConfigError("model.attention=flex: not supported with parallel.cp > 1 (CP's attention is SDPA); "
                          "set model.attention=sdpa")
    if cfg.data.get("document_positions") and dims.cp > 1:
        raise ConfigError("data.document_positions=true: not supported with parallel.cp > 1 yet (CP shards the "
                          "sequence and makes its own positions); set data.document_positions=false")
    if dims.pp > 1:
        micro = int(cfg.data.micro_batch_size or int(cfg.data.global_batch_size) // dims.dp)
        pipeline_config(cfg).validate(pp=dims.pp, n_units=args.n_layers + 2, local_batch=micro)
        if cfg.parallel.pp_schedule in V_SHAPED and cfg.trainer.limit_val_batches:
            raise LayoutError(f"trainer.limit_val_batches={cfg.trainer.limit_val_batches}: validation under "
                              f"parallel.pp_schedule={cfg.parallel.pp_schedule} fails in torch's schedule eval "
                              f"(torch 2.14); set trainer.limit_val_batches=0 or use Interleaved1F1B")
    return args, dims


def _validate_profiler(cfg: DictConfig) -> None:
    """A profiler window outside the run's steps is refused before anything is built."""
    from lit_titan.callbacks.profiler import profile_windows

    for node in (cfg.get("callbacks") or {}).values():
        if str(node.get("_target_", "")).endswith(".Profiler"):
            steps = node.get("steps")
            try:
                profile_windows(int(cfg.trainer.max_steps), list(steps) if steps is not None else None,
                                node.get("every_n_steps"), int(node.get("active", 2)))
            except ValueError as err:
                raise ConfigError(str(err)) from None


def _validate_targets(cfg: DictConfig) -> None:
    """Every logger/callback/profiler node is a ``_target_`` node, so instantiate() cannot fail late on its shape."""
    for group in ("logger", "callbacks"):
        for name, node in (cfg.get(group) or {}).items():
            if not isinstance(node, DictConfig) or "_target_" not in node:
                raise ConfigError(f"{group}.{name}={node}: has no _target_; a {group} entry is a node like "
                                  f"{{_target_: package.Class, ...}} (see conf/{group}/)")
    profiler = cfg.get("profiler")
    if profiler is not None and (not isinstance(profiler, DictConfig) or "_target_" not in profiler):
        raise ConfigError(f"profiler={profiler}: has no _target_; use profiler=simple|advanced|pytorch or a node with _target_")


def validate_launcher(cfg: DictConfig, launcher: DictConfig | None) -> None:
    """A submitit job must request exactly the ranks the layout needs: nodes x tasks per node = world size."""
    if launcher is None or "tasks_per_node" not in launcher:
        return
    nodes, tasks = int(launcher.nodes), int(launcher.tasks_per_node)
    world = world_size(cfg)
    if nodes * tasks != world:
        raise ConfigError(f"hydra.launcher asks for {nodes} node(s) x {tasks} task(s) = {nodes * tasks} ranks but the "
                          f"layout needs cluster.num_nodes x cluster.devices = {world}; drop the hydra.launcher.nodes/"
                          f"tasks_per_node overrides (the profile fills them) or change the cluster profile")
    gpus = cfg.cluster.get("gpus_per_node")
    if gpus is not None and cfg.cluster.accelerator in ("gpu", "cuda") and int(cfg.cluster.devices) > int(gpus):
        raise ConfigError(f"cluster.devices={cfg.cluster.devices} ranks per node but the profile's nodes have "
                          f"cluster.gpus_per_node={gpus}; set cluster.devices<={gpus} and raise cluster.num_nodes")
    if "Local" in str(launcher.get("_target_", "")) and nodes != 1:
        raise ConfigError(f"hydra/launcher=submitit_local runs one node, but cluster.num_nodes={nodes}; "
                          f"set cluster.num_nodes=1 (or use hydra/launcher=submitit_slurm)")


def _validate_fault(cfg: DictConfig, world: int) -> None:
    fault = cfg.get("fault") or {}
    if fault.get("kill_rank") is None:
        return
    if fault.get("at_step") is None:
        raise ConfigError(f"fault.at_step=null: fault.kill_rank={fault.kill_rank} needs the step to fail at; set "
                          f"fault.at_step=N (1..{cfg.trainer.max_steps})")
    if not 0 <= int(fault.kill_rank) < world:
        raise ConfigError(f"fault.kill_rank={fault.kill_rank}: not a rank of this {world}-process job; use 0.."
                          f"{world - 1}")
    if int(fault.at_step) > int(cfg.trainer.max_steps):
        raise ConfigError(f"fault.at_step={fault.at_step}: after the run's last step (trainer.max_steps="
                          f"{cfg.trainer.max_steps}), so the drill never fires; use 1..{cfg.trainer.max_steps}")
    if fault.get("during_save") and not cfg.checkpoint.enabled:
        raise ConfigError("fault.during_save=true: there is no save to fail during; set checkpoint.enabled=true")
    if fault.get("stage_error") and not (cfg.checkpoint.enabled and cfg.checkpoint.get("async_save", True)):
        raise ConfigError(f"fault.stage_error={fault.stage_error}: only asynchronous saves stage a copy; set "
                          "checkpoint.enabled=true checkpoint.async_save=true")


def _validate_grad_reduce_scatter(cfg: DictConfig, dims: ParallelDims) -> None:
    from lit_titan.strategies.fsdp import GRAD_REDUCE_SCATTER, PP_LAST_MICROBATCH

    mode = cfg.parallel.get("grad_reduce_scatter", "every_microbatch")
    if mode not in GRAD_REDUCE_SCATTER:
        raise ConfigError(f"parallel.grad_reduce_scatter={mode!r} is not an option; "
                          f"choose one of {GRAD_REDUCE_SCATTER}")
    if mode == "last_microbatch" and dims.pp > 1:
        raise ConfigError(PP_LAST_MICROBATCH)


def pipeline_config(cfg: DictConfig) -> PipelineConfig:
    from lit_titan.strategies.pipeline import PipelineConfig

    p = cfg.parallel
    stages = p.get("pp_stages")
    return PipelineConfig(schedule=p.pp_schedule, microbatches=p.pp_microbatches,
                          stages_per_rank=p.get("pp_stages_per_rank"),
                          stages=tuple(tuple(s) for s in stages) if stages else None)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
