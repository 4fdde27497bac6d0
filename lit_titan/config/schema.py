"""The typed schema of the whole config tree: one dataclass field per config key, with its rule.

Why a schema module: OmegaConf refuses a wrong type or an unknown key only when it has a structured
config (a dataclass) to merge into; ``lit_titan.config.schema_check`` merges the composed job config into
``TrainSchema`` (OmegaConf does the type checks) and then checks each field's ``setting(...)`` rule
(ranges, choices).

A group is its component's own settings dataclass, imported from the torch-free ``settings.py`` beside
the code that reads it (``parallel``: ``strategies/settings.py``; ``optim``; ``data``; ``checkpoint``,
``nonfinite``, ``fault``, ``preflight`` and the ``conf/callbacks/`` nodes: ``callbacks/settings.py``;
``trainer``, ``cluster``, ``loss``: ``job/settings.py``; ``fault_tolerance``: ``fault_tolerance/settings.py``), so **adding a key is one field there** and its
yaml line; the component receives the field. Declared here: the job's own top-level keys and the
nodes of Lightning's loggers and profilers (their constructors are Lightning's). A ``model.*`` key is one
``setting()`` on its family's arguments dataclass (``models/<family>/args.py``): ``model_schema`` builds
the model group from it.

A yaml key without a field is refused by name (``tests/unit/config/test_schema.py`` composes every option
of every group). ``_target_`` nodes (callbacks, loggers, profiler) are looked up by their ``_target_`` in
``TARGET_SCHEMAS``; a user's own class is checked by its constructor's signature instead.

``key(...)`` fields default to ``MISSING``: the yaml files hold the defaults, this module only says what is
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

from lit_titan.callbacks.settings import (
    TARGETS,
    CheckpointConfig,
    FaultConfig,
    NonFiniteConfig,
    PreflightConfig,
)
from lit_titan.data.settings import DataConfig
from lit_titan.fault_tolerance.settings import FaultToleranceConfig
from lit_titan.job.settings import LAUNCHERS, PRECISIONS, ClusterConfig, LossConfig, TrainerConfig
from lit_titan.optim.settings import OptimConfig
from lit_titan.settings import non_empty_str, path_or_null, setting
from lit_titan.strategies.settings import ParallelConfig

# Choices only the config checks (the component-owned lists come with their settings dataclasses).
__all__ = ["LAUNCHERS", "TrainSchema", "TARGET_SCHEMAS", "key"]


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
    specs: list[tuple[str, Any, Any]] = [("name", str, key(check=non_empty_str))] if top else []
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
class TrainSchema:  # conf/train.yaml: the job config (the `hydra:` node is Hydra's, checked by Hydra)
    seed: int = key(ge=0)
    run_dir: str | None = key()
    precision: str = key(choices=PRECISIONS)
    tf32: bool = key()
    resume: str | None = key(check=non_empty_str)
    model: dict[str, Any] = key()  # typed per family: train_schema()
    # {_target_: a PretrainModule class, its own arguments}: checked against its constructor (config/module_node.py)
    module: dict[str, Any] = key()
    data: DataConfig = field(default_factory=DataConfig)  # what PretrainDataModule is built from
    optim: OptimConfig = field(default_factory=OptimConfig)  # what optim/build.py builds from
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the Trainer's devices, the planner's facts
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TitanStrategy's own argument
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # Lightning Trainer arguments
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)  # TitanStrategy's
    # _target_ nodes: each checked against TARGET_SCHEMAS[its _target_] (lit_titan.config.schema_check)
    logger: dict[str, Any] | None = key()
    callbacks: dict[str, Any] | None = key()
    profiler: dict[str, Any] | None = key()


# ---- Lightning's _target_ nodes (conf/logger/, conf/profiler/): the keys of theirs that our yaml sets ------
@dataclass
class CSVLoggerSchema:
    _target_: str = key()
    save_dir: str | None = key(check=path_or_null)  # null until run_dir is chosen
    name: str = key()
    version: str = key()


@dataclass
class TensorBoardLoggerSchema(CSVLoggerSchema):
    pass


@dataclass
class WandbLoggerSchema:
    _target_: str = key()
    save_dir: str | None = key(check=path_or_null)  # null until run_dir is chosen
    project: str = key(check=non_empty_str)
    offline: bool = key()


@dataclass
class LightningProfilerSchema:  # Simple/Advanced/PyTorch profilers: the keys conf/profiler/ sets
    _target_: str = key()
    dirpath: str | None = key(check=path_or_null)  # null until run_dir is chosen
    filename: str = key(check=non_empty_str)


TARGET_SCHEMAS: dict[str, type] = {
    **TARGETS,  # our callbacks: their own settings (callbacks/settings.py)
    "lightning.pytorch.loggers.CSVLogger": CSVLoggerSchema,
    "lit_titan.observe.csv_logger.RunDirCSVLogger": CSVLoggerSchema,  # conf/logger/csv.yaml
    "lightning.pytorch.loggers.TensorBoardLogger": TensorBoardLoggerSchema,
    "lightning.pytorch.loggers.WandbLogger": WandbLoggerSchema,
    "lightning.pytorch.profilers.SimpleProfiler": LightningProfilerSchema,
    "lightning.pytorch.profilers.AdvancedProfiler": LightningProfilerSchema,
    "lightning.pytorch.profilers.PyTorchProfiler": LightningProfilerSchema,
}

__all__ = ["TrainSchema", "TARGET_SCHEMAS", "key", "model_schema", "train_schema"]
