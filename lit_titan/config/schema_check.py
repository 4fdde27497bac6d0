"""Check a composed job config against ``lit_titan.config.schema``: types, unknown keys, ranges and choices.

OmegaConf does the type and unknown-key checks (merging the resolved config into the structured
``TrainSchema``); this module adds what OmegaConf 2.3 lacks (ranges, choices, union-like keys such as
``loss.chunk_tokens=auto|N``) from each field's ``key(...)`` rule, and turns every failure into one
``ConfigError`` line ``<key>=<value>: <what is wrong>; <what to do>``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException, ValidationError

from lit_titan.config.module_node import check_module_node
from lit_titan.config.schema import TARGET_SCHEMAS, TrainSchema, train_schema
from lit_titan.errors import ConfigError, one_line

TARGET_GROUPS = ("logger", "callbacks")


def check_schema(cfg: DictConfig) -> None:
    """Refuse the first key of ``cfg`` (a job config, without ``hydra:``) that breaks the schema."""
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    # First as written (interpolations unresolved), so a bad value is named where it was set and not
    # where it is used (trainer.max_steps=abc, not optim.total_steps); then resolved.
    written = OmegaConf.to_container(job, resolve=False)
    schema = schema_for(written)
    check_groups(schema, written, "")
    _merge(schema, written, "")
    check_rules(schema, written, "")
    data = resolved(cfg)
    _merge(schema, data, "")
    check_rules(schema, data, "")
    for group in TARGET_GROUPS:
        nodes = data.get(group) or {}
        for name, node in nodes.items():
            check_target_node(node, f"{group}.{name}")
    if data.get("profiler") is not None:
        check_target_node(data["profiler"], "profiler")
    if "module" in data:
        check_module_node(data["module"])


def schema_for(data: dict[str, Any]) -> type:
    """The job schema whose model group is the family of ``data``'s flavor (``model.name``)."""
    model = data.get("model")
    if not isinstance(model, dict) or "name" not in model or _is_interpolation(model["name"]):
        return train_schema(None)
    name = model["name"]
    schema = train_schema(name) if isinstance(name, str) else None
    if schema is None or schema is TrainSchema:
        from lit_titan.models.registry import flavor_names

        raise ConfigError(
            f"model.name={_show(name)}: not a model flavor; choose model=<one of {', '.join(flavor_names())}>"
        )
    return schema


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """The job config as plain Python values, every interpolation resolved (a failing one named)."""
    try:
        return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    except InterpolationResolutionError as err:
        raise ConfigError(
            f"{err.full_key}: {one_line(err.msg)}; fix the ${{...}} reference or set {err.full_key} to a value"
        ) from None


def check_target_node(node: Any, where: str) -> None:
    """A logger/callback/profiler node: a ``_target_`` whose keys its schema (or its class) accepts."""
    if not isinstance(node, dict) or "_target_" not in node:
        group = where.split(".")[0]
        raise ConfigError(
            f"{where}={_show(node)}: has no _target_; a {group} entry is a node like "
            f"{{_target_: package.Class, ...}} (see conf/{group}/)"
        )
    target = str(node["_target_"])
    schema = TARGET_SCHEMAS.get(target)
    if schema is not None:
        _merge(schema, node, where + ".")
        check_rules(schema, node, where + ".")
        return
    accepted = _signature_keys(target, where)  # a user's own class: its constructor says what it takes
    unknown = [k for k in node if k != "_target_" and accepted is not None and k not in accepted]
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}={_show(node[unknown[0]])}: {target} takes no argument "
            f"{unknown[0]!r}; use one of {', '.join(sorted(accepted)) or '(none)'}"
        )


def check_groups(schema: type, data: dict[str, Any], prefix: str) -> None:
    """A group of settings replaced by one value (``checkpoint=false``) names the key the user meant.

    OmegaConf reports it against the parent node (an empty key and the whole config), so it is
    found here first: the group's ``enabled`` switch, its only key, or the list of its keys.
    """
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in data or data[f.name] is None or _is_interpolation(data[f.name]):
            continue
        value, path, kind = data[f.name], prefix + f.name, hints[f.name]
        if is_union(kind):  # Optional[Group]
            kind = next((a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)), kind)
        if not dataclasses.is_dataclass(kind):
            continue
        if isinstance(value, dict):
            check_groups(kind, value, path + ".")
            continue
        keys = [k.name for k in dataclasses.fields(kind)]
        meant = "enabled" if "enabled" in keys else keys[0] if len(keys) == 1 else None
        hint = (
            f"did you mean {path}.{meant}={_show(value)}?"
            if meant
            else f"set one of its keys instead ({', '.join(f'{path}.{k}' for k in keys)})"
        )
        raise ConfigError(f"{path}={_show(value)}: {path} is a group of settings; {hint}")


def check_rules(schema: type, data: dict[str, Any], prefix: str) -> None:
    """Each present field's ``key(...)`` rule (schema.py), recursing into nested dataclasses and lists of them."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in data:
            continue
        value, path, kind = data[f.name], prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(value, dict):
            check_rules(kind, value, path + ".")
            continue
        inner = _list_item_type(kind)
        if inner is not None and dataclasses.is_dataclass(inner) and isinstance(value, list):
            for i, item in enumerate(value):
                check_rules(inner, item, f"{path}[{i}].")
            continue
        problem = rule_problem(f.metadata.get("rule", {}), value)
        if problem:
            raise ConfigError(f"{path}={_show(value)}: {problem}")


def rule_problem(rule: dict[str, Any], value: Any) -> str | None:
    """What is wrong with ``value`` under ``rule`` and what to set instead, or None."""
    if value is None or value in rule.get("allow", ()) or _is_interpolation(value):
        return None
    if "check" in rule:
        problem = rule["check"](value)
        if problem:
            return problem
    if "choices" in rule and value not in rule["choices"]:
        return f"not an option; choose one of {', '.join(map(str, rule['choices']))}"
    bounds = [
        ("ge", ">=", lambda v, b: v >= b),
        ("gt", ">", lambda v, b: v > b),
        ("le", "<=", lambda v, b: v <= b),
        ("lt", "<", lambda v, b: v < b),
    ]
    broken = [
        (sign, rule[name])
        for name, sign, ok in bounds
        if name in rule and isinstance(value, (int, float)) and not ok(value, rule[name])
    ]
    if broken:
        valid = " and ".join(f"{sign} {_num(b)}" for name, sign, _ in bounds if name in rule for b in [rule[name]])
        extra = f" (or {', '.join(map(str, rule['allow']))})" if rule.get("allow") else ""
        return f"out of range; use a value {valid}{extra}"
    return None


def field_types(schema: type = TrainSchema, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of ``schema`` with its type (nested dataclasses flattened): what the tests fuzz."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(field_types(kind, prefix + f.name + "."))
        else:
            out[prefix + f.name] = kind
    return out


def field_rule(schema: type, dotted: str) -> dict[str, Any]:
    """The ``key(...)`` rule of one dotted key of ``schema``."""
    head, _, rest = dotted.partition(".")
    f = {f.name: f for f in dataclasses.fields(schema)}[head]
    kind = typing.get_type_hints(schema)[head]
    return field_rule(kind, rest) if rest else f.metadata.get("rule", {})


def compose_error_line(text: str, overrides: list[str], options: Callable[[str], list[str]]) -> str | None:
    """Hydra's composition errors as ``<override>: <what is wrong>; <what to do>`` (None: not one of these).

    ``options(group)``: the group's options (its yaml files, including a ``--config-dir``'s).
    """
    import re

    missing = re.search(r"Could not override '([^']+)'", text)
    if missing:
        key = missing.group(1)
        given = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), key)
        if key.split(".")[0] == "module":  # the module's own arguments are the user's keys, added with +
            return (
                f"{given}: not set in conf/train.yaml; add the module's own constructor arguments with a +: "
                f"module._target_=package.module.Class +module.<argument>=VALUE"
            )
        return (
            f"{given}: {key} is not a config key; check its spelling (python -m lit_titan.train --cfg job lists "
            f"every key); a new key needs a yaml line and one line in {declared_in(TrainSchema, key)} "
            f"(docs/configuration.md)"
        )
    group = re.search(r"Could not (?:find|load) '([^']+)'", text)
    if group:
        name = group.group(1)
        parent, _, choice = name.rpartition("/")
        try:
            valid = options(parent)
        except Exception:  # noqa: BLE001 - the line is still useful without the list
            valid = []
        return (
            f"{parent}={choice}: no such option"
            + (f"; choose one of {', '.join(valid)}" if valid else "")
            + f" (your own files: --config-dir DIR with DIR/{parent}/NAME.yaml)"
        )
    parse = re.search(r"Error parsing override '([^']+)'", text)
    if parse:
        return f"{parse.group(1)}: cannot parse this override; write KEY=VALUE (or group=option, +KEY=VALUE)"
    return None


# ---- helpers --------------------------------------------------------------------------------------------
@functools.cache
def _structured(schema: type) -> DictConfig:
    """The schema as an OmegaConf node, built once per process: building it costs ~16 ms, and
    ``OmegaConf.merge`` copies its first argument, so the cached node is never changed."""
    return OmegaConf.structured(schema)


def _merge(schema: type, data: dict[str, Any], prefix: str) -> None:
    """OmegaConf's own type and unknown-key checks, as one line naming the key."""
    try:
        OmegaConf.merge(_structured(schema), data)
    except ConfigKeyError as err:
        full = prefix + str(err.full_key)
        node, name = _parent(schema, str(err.full_key))
        valid = ", ".join(f.name for f in dataclasses.fields(node)) if node else ""
        raise ConfigError(
            f"{full}={_show(_lookup(data, str(err.full_key)))}: not a config key; check its spelling"
            + (f" (keys here: {valid})" if valid else "")
            + f"; a new key needs one line in {declared_in(schema, str(err.full_key))} (docs/configuration.md)"
        ) from None
    except (ValidationError, OmegaConfBaseException) as err:
        key = str(getattr(err, "full_key", "") or "")
        full = prefix + key
        kind = _type_of(schema, key)
        raise ConfigError(f"{full}={_show(_lookup(data, key))}: wrong type; {full} takes {_type_name(kind)}") from None


def _signature_keys(target: str, where: str) -> set[str] | None:
    """Parameter names of ``target``'s constructor; None when it takes **kwargs."""
    module, _, name = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"{where}._target_={target}: cannot be imported ({one_line(str(err))}); "
            f"give a full dotted path package.module.Class"
        ) from None
    params = inspect.signature(obj).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name != "self"}


def declared_in(schema: type, dotted: str) -> str:
    """The file holding the dataclass a new key under ``dotted``'s group goes in: a component's
    ``settings.py`` (e.g. ``lit_titan/optim/settings.py``) or ``lit_titan/config/schema.py``."""
    node: Any = schema
    for part in dotted.split(".")[:-1]:
        kind = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(kind):
            break
        node = kind
    return node.__module__.replace(".", "/") + ".py"


def _parent(schema: type, dotted: str) -> tuple[type | None, str]:
    parts = dotted.split(".")
    node: Any = schema
    for part in parts[:-1]:
        hints = typing.get_type_hints(node)
        node = hints.get(part)
        inner = _list_item_type(node)
        node = inner if inner is not None else node
        if not dataclasses.is_dataclass(node):
            return None, parts[-1]
    return node, parts[-1]


def is_union(kind: Any) -> bool:
    """``Optional[X]`` and ``X | None`` alike: ``typing.get_origin`` tells them apart (``typing.Union`` and
    ``types.UnionType``), and the schema is written in the second spelling."""
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _type_of(schema: type, dotted: str) -> Any:
    node, name = _parent(schema, dotted.split("[")[0])
    return typing.get_type_hints(node).get(name) if node else None


def _list_item_type(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (list,):
        return args[0] if args else None
    if is_union(kind) and len(args) == 1:
        return _list_item_type(args[0])
    return None


def _type_name(kind: Any) -> str:
    if kind is None:
        return "another type"
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if is_union(kind) and len(args) == 1:
        return f"{_type_name(args[0])} or null"
    origin = typing.get_origin(kind)
    if origin in (list,):
        return "a list" + (f" of {_type_name(args[0])}" if args and args[0] is not Any else "")
    if origin in (dict,):
        return "a mapping {key: value}"
    if dataclasses.is_dataclass(kind):
        return "a mapping {" + ", ".join(f.name for f in dataclasses.fields(kind)) + "}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, str(kind))


def _lookup(data: Any, dotted: str) -> Any:
    for part in [p for p in dotted.replace("]", "").replace("[", ".").split(".") if p]:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str).replace('"', "")
    return str(value)


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


__all__ = [
    "check_schema",
    "schema_for",
    "check_groups",
    "check_rules",
    "check_target_node",
    "field_types",
    "field_rule",
    "rule_problem",
]
