"""The ``module`` node: which ``PretrainModule`` class a job trains (``module._target_``) and its own arguments.

Why a node: ``train``, sweeps and ``plan`` then take a subclass by name, with no Python launcher. The keys
beside ``_target_`` are the class's own constructor arguments; the others come from their groups
(``BUILT``), so they are not set here. The class is imported (the user's explicit choice; nothing else of it
runs) and checked against its constructor before anything is built: every refusal is one ``ConfigError`` line.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.errors import ConfigError, one_line

DEFAULT_TARGET = "lit_titan.PretrainModule"

# PretrainModule's arguments that job/build.py's build_module fills from other keys: the override setting each.
BUILT: dict[str, str] = {
    "model": "model=<flavor>",
    "model_overrides": "model.<key>=...",
    "optim": "optim.<key>=...",
    "seed": "seed=...",
    "init_from_hf": "model.init_from_hf=...",
    "loss_chunk_tokens": "loss.chunk_tokens=...",
    "step_micro_batch": "data.micro_batch_size=...",
}

# Hooks the step runner owns (strategies/step.py): a subclass overriding one is refused when it is named.
RUNNER_HOOKS = ("training_step", "validation_step")

__all__ = ["BUILT", "DEFAULT_TARGET", "check_module_node", "module_arguments", "module_class", "module_node"]


def module_node(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The job's ``module`` node as plain values; absent (a ``config.yaml`` written before it existed):
    ``PretrainModule`` itself."""
    node = cfg.get("module")
    if node is None:
        return {"_target_": DEFAULT_TARGET}
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def module_arguments(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node's own constructor arguments (every key but ``_target_``)."""
    return {k: v for k, v in node.items() if k != "_target_"}


def module_class(target: str) -> type:
    """The class ``target`` names, imported; refused in one line unless it is ``PretrainModule`` or a
    subclass that leaves the step runner's hooks alone."""
    path, _, name = target.rpartition(".")
    if not path or not name:
        raise ConfigError(f"module._target_={target}: not a dotted path; give package.module.Class")
    try:
        obj = getattr(importlib.import_module(path), name)
    except Exception as err:  # noqa: BLE001 - the user's module may raise anything on import: one line all the same
        raise ConfigError(
            f"module._target_={target}: cannot be imported ({one_line(err, with_type=True)}); give "
            f"package.module.Class, importable here (on sys.path / PYTHONPATH)"
        ) from None
    from lit_titan.module import PretrainModule

    if not (isinstance(obj, type) and issubclass(obj, PretrainModule)):
        what = (
            f"the class {obj.__module__}.{obj.__qualname__}"
            if isinstance(obj, type)
            else f"a {type(obj).__name__} value"
        )
        raise ConfigError(
            f"module._target_={target}: not a PretrainModule subclass (it is {what}); subclass "
            f"lit_titan.PretrainModule (README, Subclassing)"
        )
    for hook in RUNNER_HOOKS:
        if getattr(obj, hook) is not getattr(PretrainModule, hook):
            raise ConfigError(
                f"module._target_={target}: overrides {hook}, which TitanStrategy's step runner owns (one normaliser "
                f"over every layout); override compute_loss, split_batch, count_targets or record_train_loss instead"
            )
    return obj


def check_module_node(node: Any) -> None:
    """``node``'s class and its own arguments against the class's constructor, before anything is built."""
    if not isinstance(node, Mapping) or not isinstance(node.get("_target_"), str) or not node["_target_"]:
        raise ConfigError(
            f"module={node}: not a node with a _target_; use module._target_=package.module.Class "
            f"(+module.KEY=VALUE for its own arguments)"
        )
    target, extra = node["_target_"], module_arguments(node)
    for key, value in extra.items():
        if key in BUILT:
            raise ConfigError(f"module.{key}={value}: lit-titan passes {key} itself; set {BUILT[key]} instead")
    if target == DEFAULT_TARGET and not extra:
        return  # PretrainModule itself: no import needed (a command that builds nothing stays fast)
    _check_signature(module_class(target), target, extra)


def _check_signature(cls: type, target: str, extra: Mapping[str, Any]) -> None:
    """The constructor takes what build_module passes (``BUILT`` plus ``extra``), and needs nothing else."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to read (a C-implemented constructor): the call itself will say
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        own = ", ".join(sorted(set(named) - set(BUILT))) or "(none)"
        for key, value in extra.items():
            if key not in named:
                raise ConfigError(f"module.{key}={value}: {target} takes no argument {key!r}; its own arguments: {own}")
        dropped = [k for k in BUILT if k not in named]
        if dropped:
            raise ConfigError(
                f"module._target_={target}: its constructor takes no {dropped[0]!r}, which lit-titan passes (with "
                f"{', '.join(k for k in BUILT if k != dropped[0])}); accept **kwargs and pass them to "
                f"PretrainModule.__init__"
            )
    needed = [k for k, p in named.items() if p.default is p.empty and k not in BUILT and k not in extra]
    if needed:
        raise ConfigError(f"module._target_={target}: needs its argument {needed[0]!r}; add +module.{needed[0]}=VALUE")
