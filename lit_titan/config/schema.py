"""The typed schema of the whole config tree: one dataclass field per config key, with its range.

Why a schema module: OmegaConf refuses a wrong type or an unknown key only when it has a structured
config (a dataclass) to merge into; ``lit_titan.config.schema_check`` merges the composed job config into
``TrainSchema`` (OmegaConf does the type checks) and then checks each field's ``key(...)`` rule
(ranges, choices). So **adding a config key is one line here**, in the dataclass of its group::

    max_restarts: int | None = key(ge=0)          # in ClusterSchema, for conf/cluster/*.yaml's cluster.max_restarts

(a ``model.*`` key is one ``setting()`` on its family's arguments dataclass, ``models/<family>/args.py``:
``model_schema`` builds the model group from it) and a yaml key without such a line is refused by name (``tests/unit/config/test_schema.py`` composes every option of
every group, so a new yaml key with no schema line fails the suite). ``_target_`` nodes (callbacks,
loggers, profiler) are looked up by their ``_target_`` in ``TARGET_SCHEMAS``; a user's own class is
checked by its constructor's signature instead.

Defaults are ``MISSING`` on purpose: the yaml files hold the defaults, this module only says what is
allowed (a group option that leaves a key out is fine).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from lit_titan.data.settings import DataConfig
from lit_titan.optim.settings import OptimConfig
from lit_titan.settings import setting
from lit_titan.strategies.settings import AC_MODES, FLOAT8_RECIPES, ParallelConfig

# Choices only the config checks. The choices a component checks itself are imported above from the
# torch-free module that declares them; the launchers are the config's own (cli/launch.py imports them).
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
ATTENTIONS = ("sdpa", "flex")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LAUNCHERS = ("torchrun", "srun")
NONFINITE_ACTIONS = ("stop", "skip_step")


def key(
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    allow: Sequence[Any] = (),
) -> Any:
    """A config key's rule: bounds (``ge``/``gt``/``le``/``lt``), ``choices``, or ``check(value)`` returning
    what is wrong (None: fine). ``allow``: extra values accepted outside the bounds (``dp_shard=-1``).
    None passes every rule (the field's ``Optional[...]`` type decides whether null is allowed)."""
    return setting(MISSING, ge=ge, gt=gt, le=le, lt=lt, choices=choices, check=check, allow=allow)


def _chunk_tokens(value: Any) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    return "not auto or a token count; use auto, 0 (off) or a positive number of tokens"


def _number_or_fraction(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return "not a count or a fraction; use an int >= 0 (that many) or a float in [0, 1] (that fraction)"
    if isinstance(value, float) and value > 1:
        return "a float is a fraction; use one in [0, 1], or an int for a count"
    return None


def _positive_number_or_fraction(value: Any) -> str | None:
    problem = _number_or_fraction(value)
    return problem or ("zero; use an int >= 1 or a fraction in (0, 1]" if value == 0 else None)


def _non_empty_str(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "empty or not a string; give a non-empty string"


def _errno_name(value: Any) -> str | None:
    import errno

    return (
        None if isinstance(value, str) and hasattr(errno, value) else "not an errno name; use e.g. ENOSPC, EACCES, EIO"
    )


def _path_like(value: Any) -> str | None:
    return None if value is None or isinstance(value, str) else "not a path; give a path (a string) or null"


# ---- groups ---------------------------------------------------------------------------------------------
# The model group (conf/model/*.yaml) has no class here: each family's arguments dataclass declares its
# keys with setting() (models/<family>/args.py), and model_schema() turns it into the group's schema;
# train_schema() picks the family by the flavor (model.name).
def _schema_type(kind: Any) -> Any:
    """A family argument's type as a config key: null allowed (null keeps the flavor's value)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if is_optional(kind) and len(args) == 1 else kind
    if dataclasses.is_dataclass(base):
        # a switchable sub-structure (rope_scaling: null turns it off) is a mapping; a fixed one a group
        return dict[str, Any] | None if base is not kind else model_schema(base, top=False)
    if typing.get_origin(base) is tuple:
        return list[typing.get_args(base)[0]] | None
    return base | None


def is_optional(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)


@functools.cache
def model_schema(args_cls: type, top: bool = True) -> type:
    """The schema of a family's arguments dataclass: each field a key with its ``setting()`` rule.

    ``top``: the model group itself, which also has ``name`` (the flavor) and ``init_from_hf``."""
    hints = typing.get_type_hints(args_cls)
    specs: list[tuple[str, Any, Any]] = [("name", str, key(check=_non_empty_str))] if top else []
    for f in dataclasses.fields(args_cls):
        specs.append((f.name, _schema_type(hints[f.name]), key(**f.metadata.get("rule", {}))))
    if top:
        specs.append(("init_from_hf", str | None, key()))
    return dataclasses.make_dataclass(f"{args_cls.__name__}Schema", specs)


@functools.cache
def train_schema(model_name: str | None) -> type:
    """``TrainSchema`` with its model group typed by the family of ``model_name`` (None or unknown: untyped,
    the flavor is refused by name later)."""
    if not model_name:
        return TrainSchema
    from lit_titan.models.registry import args_class  # the family's arguments (imports the family)

    cls = args_class(model_name)
    if cls is None:
        return TrainSchema
    group = model_schema(cls)
    return dataclasses.make_dataclass(
        f"TrainSchema_{group.__name__}",
        [("model", group, field(default_factory=group))],
        bases=(TrainSchema,),
    )


@dataclass
class ClusterSchema:  # conf/cluster/*.yaml
    accelerator: str = key(choices=ACCELERATORS)
    devices: int = key(ge=1)
    num_nodes: int = key(ge=1)
    launcher: str = key(choices=LAUNCHERS)
    precision: str = key(choices=PRECISIONS)
    gpus_per_node: int | None = key(ge=1)
    hbm_gib: float | None = key(gt=0)
    hbm_gbps: float | None = key(gt=0)
    peak_bf16_tflops: float | None = key(gt=0)
    peak_fp32_tflops: float | None = key(gt=0)
    fp8: bool | None = key()
    intra_node_gbps: float | None = key(gt=0)
    inter_node_gbps: float | None = key(gt=0)
    cores_per_node: int | None = key(ge=1)
    timeout_s: int = key(ge=1)
    log_every_n_steps: int = key(ge=1)
    data_workers: int = key(ge=0)
    flight_recorder_entries: int = key(ge=0)
    # optional profile keys (no yaml of ours sets them): launches (lit-titan launch, hydra/launcher=submitit_*)
    max_restarts: int | None = key(ge=0)
    partition: str | None = key(check=_non_empty_str)
    account: str | None = key(check=_non_empty_str)
    qos: str | None = key(check=_non_empty_str)
    constraint: str | None = key(check=_non_empty_str)
    time_min: int | None = key(ge=1)
    cpus_per_task: int | None = key(ge=1)
    mem_gb: float | None = key(gt=0)
    sbatch: dict[str, Any] | None = key()
    setup: list[str] | None = key()


@dataclass
class LossSchema:
    chunk_tokens: Any = key(check=_chunk_tokens)


@dataclass
class TrainerSchema:
    max_steps: int = key(ge=1)
    gradient_clip_val: float | None = key(ge=0)
    log_every_n_steps: int = key(ge=1)
    limit_val_batches: Any = key(check=_number_or_fraction)
    val_check_interval: Any = key(check=_positive_number_or_fraction)
    enable_progress_bar: bool = key()
    deterministic: bool = key()


@dataclass
class CheckpointSchema:
    enabled: bool = key()
    every_n_steps: int = key(ge=0)
    keep_last: int = key(ge=0)
    async_save: bool = key()


@dataclass
class NonFiniteSchema:  # the non-finite guard (lit_titan/callbacks/nonfinite.py), a top-level group
    enabled: bool = key()
    action: str = key(choices=NONFINITE_ACTIONS)
    max_consecutive_skips: int = key(ge=1)


@dataclass
class FaultSchema:
    kill_rank: int | None = key(ge=0)
    at_step: int | None = key(ge=1)
    during_save: bool = key()
    save_error: str | None = key(check=_errno_name)
    stage_error: str | None = key(check=_errno_name)
    pause: bool = key()
    slow_rank: int | None = key(ge=0)  # the pre-flight drill
    slow_factor: float = key(gt=0)
    slow_link: str | None = key(choices=("intra_node", "inter_node", "pp", "dp_replicate", "dp_shard", "cp", "tp"))


@dataclass
class PreflightSchema:  # pre-flight diagnostics (lit_titan/observe/diagnostics.py)
    enabled: bool = key()
    action: str = key(choices=("warn", "stop"))
    threshold: float = key(gt=0, le=1)
    only: bool = key()


@dataclass
class TrainSchema:  # conf/train.yaml: the job config (the `hydra:` node is Hydra's, checked by Hydra)
    seed: int = key(ge=0)
    run_dir: str | None = key()
    precision: str = key(choices=PRECISIONS)
    tf32: bool = key()
    resume: str | None = key(check=_non_empty_str)
    model: dict[str, Any] = key()  # typed per family: train_schema()
    data: DataConfig = field(default_factory=DataConfig)  # what PretrainDataModule is built from
    optim: OptimConfig = field(default_factory=OptimConfig)  # what optim/build.py builds from
    cluster: ClusterSchema = field(default_factory=ClusterSchema)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TitanStrategy's own argument
    loss: LossSchema = field(default_factory=LossSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    nonfinite: NonFiniteSchema = field(default_factory=NonFiniteSchema)
    fault: FaultSchema = field(default_factory=FaultSchema)
    preflight: PreflightSchema = field(default_factory=PreflightSchema)
    # _target_ nodes: each checked against TARGET_SCHEMAS[its _target_] (lit_titan.config.schema_check)
    logger: dict[str, Any] | None = key()
    callbacks: dict[str, Any] | None = key()
    profiler: dict[str, Any] | None = key()


# ---- _target_ nodes (conf/callbacks/, conf/logger/, conf/profiler/) --------------------------------------
@dataclass
class ActivationCheckpointingSchema:
    _target_: str = key()
    mode: str = key(choices=AC_MODES)
    every_n_layers: int = key(ge=1)


@dataclass
class CompileSchema:
    _target_: str = key()
    fullgraph: bool = key()
    backend: str = key(check=_non_empty_str)
    mode: str | None = key(check=_non_empty_str)
    compile_loss: bool = key()


@dataclass
class Float8Schema:
    _target_: str = key()
    recipe: str = key(choices=FLOAT8_RECIPES)
    enable_fsdp_float8_all_gather: bool = key()
    precompute_scales: bool = key()
    emulate: bool = key()
    filter_fqns: list[str] = key()
    min_dim: int = key(ge=1)
    auto_filter_small_kn: bool = key()
    float8_tp: bool = key()


@dataclass
class ProfilerCallbackSchema:
    _target_: str = key()
    steps: list[int] | None = key(
        check=lambda v: None if all(s >= 1 for s in v) else "steps count from 1; use e.g. [3, 4]"
    )
    every_n_steps: int | None = key(ge=1)
    active: int = key(ge=1)
    warmup: int = key(ge=0)
    record_shapes: bool = key()
    with_stack: bool = key()
    profile_memory: bool = key()
    memory_snapshot: bool = key()
    oom_snapshot: bool = key()
    run_dir: str | None = key(check=_path_like)


@dataclass
class StragglerSchema:
    _target_: str = key()
    every_n_steps: int = key(ge=1)
    warn_ratio: float = key(gt=1)


@dataclass
class ThroughputSchema:
    _target_: str = key()
    warmup_steps: int = key(ge=0)
    log_memory: bool = key()
    peak_tflops: float | None = key(gt=0)


@dataclass
class TimelineSchema:
    _target_: str = key()
    run_dir: str | None = key(check=_path_like)


@dataclass
class WatchdogSchema:
    _target_: str = key()
    timeout_s: float = key(gt=0)
    first_step_timeout_s: float = key(gt=0)
    run_dir: str | None = key(check=_path_like)
    exit_code: int = key(ge=1, le=255)
    exit_delay_s: float = key(ge=0)
    backstop_s: float = key(ge=0)


@dataclass
class CSVLoggerSchema:
    _target_: str = key()
    save_dir: str | None = key(check=_path_like)  # null until run_dir is chosen
    name: str = key()
    version: str = key()


@dataclass
class TensorBoardLoggerSchema(CSVLoggerSchema):
    pass


@dataclass
class WandbLoggerSchema:
    _target_: str = key()
    save_dir: str | None = key(check=_path_like)  # null until run_dir is chosen
    project: str = key(check=_non_empty_str)
    offline: bool = key()


@dataclass
class LightningProfilerSchema:  # Simple/Advanced/PyTorch profilers: the keys conf/profiler/ sets
    _target_: str = key()
    dirpath: str | None = key(check=_path_like)  # null until run_dir is chosen
    filename: str = key(check=_non_empty_str)


TARGET_SCHEMAS: dict[str, type] = {
    "lit_titan.callbacks.ActivationCheckpointing": ActivationCheckpointingSchema,
    "lit_titan.callbacks.Compile": CompileSchema,
    "lit_titan.callbacks.Float8": Float8Schema,
    "lit_titan.callbacks.Profiler": ProfilerCallbackSchema,
    "lit_titan.callbacks.StragglerReport": StragglerSchema,
    "lit_titan.callbacks.ThroughputMonitor": ThroughputSchema,
    "lit_titan.callbacks.Timeline": TimelineSchema,
    "lit_titan.callbacks.Watchdog": WatchdogSchema,
    "lightning.pytorch.loggers.CSVLogger": CSVLoggerSchema,
    "lit_titan.observe.csv_logger.RunDirCSVLogger": CSVLoggerSchema,  # conf/logger/csv.yaml
    "lightning.pytorch.loggers.TensorBoardLogger": TensorBoardLoggerSchema,
    "lightning.pytorch.loggers.WandbLogger": WandbLoggerSchema,
    "lightning.pytorch.profilers.SimpleProfiler": LightningProfilerSchema,
    "lightning.pytorch.profilers.AdvancedProfiler": LightningProfilerSchema,
    "lightning.pytorch.profilers.PyTorchProfiler": LightningProfilerSchema,
}

__all__ = ["TrainSchema", "TARGET_SCHEMAS", "key", "model_schema", "train_schema"]
