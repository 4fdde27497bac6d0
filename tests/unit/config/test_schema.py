"""The typed schema (lit_titan/config/schema.py), fuzzed key by key through ``validate``, the function the CLI calls.

Generated from the config tree itself: every option of every group is composed, and every leaf key
it holds is given a value of the wrong type and (numeric keys) a negative one, and zero where the
schema says it must be positive. Each case must be refused with one line that starts with the key.
A yaml key that has no field (in its component's settings dataclass, or schema.py) fails here by name
(test_every_yaml_key_has_a_schema_line).
"""

from __future__ import annotations

import copy
import functools
import time
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from lit_titan.config import ConfigError, compose, conf_dir, validate
from lit_titan.config.schema import TARGET_SCHEMAS
from lit_titan.config.schema_check import field_types, is_union, rule_problem, schema_for
from paths import ROOT

GROUPS = ("model", "data", "optim", "cluster", "parallel", "callbacks", "logger", "profiler")
LIST_GROUPS = ("callbacks", "logger")  # groups whose override is a list of options


def group_options() -> list[str]:
    """Every option of every group as an override (``recipe`` too), read from conf/."""
    out = []
    for group in (*GROUPS, "recipe"):
        for f in sorted((conf_dir() / group).glob("*.yaml")):
            out.append(
                f"+recipe={f.stem}"
                if group == "recipe"
                else f"{group}=[{f.stem}]"
                if group in LIST_GROUPS
                else f"{group}={f.stem}"
            )
    return out


OPTIONS = group_options()


@functools.cache
def composed(option: str | None) -> DictConfig:
    return compose([option] if option else [])


def schema_leaves(cfg: DictConfig) -> dict[str, Any]:
    """Every leaf key of ``cfg`` with its schema type (None: no schema line); schema leaves (lists, mappings
    such as model.rope_scaling) are not descended into."""
    types = field_types(schema_of(cfg))
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str, types: dict[str, Any]) -> None:
        for k in node:
            path, value = f"{prefix}{k}", node[k]
            if isinstance(value, dict) and value.get("_target_") in TARGET_SCHEMAS:  # callbacks.x, profiler
                walk(value, path + ".", field_types(TARGET_SCHEMAS[value["_target_"]], path + "."))
            elif isinstance(value, dict) and path in ("logger", "callbacks"):
                walk(value, path + ".", types)
            elif path in types:
                out[path] = types[path]
            elif isinstance(value, dict) and any(t.startswith(path + ".") for t in types):
                walk(value, path + ".", types)
            else:
                out[path] = None

    data = OmegaConf.to_container(cfg, resolve=False)
    walk(data, "", types)
    return out


def schema_of(cfg: DictConfig) -> type:
    """The job schema with the model group of ``cfg``'s family (``model.*`` keys are the family's)."""
    return schema_for(OmegaConf.to_container(cfg, resolve=False))


def bad_values(kind: Any, rule: dict[str, Any]) -> list[tuple[str, Any]]:
    """(what, value) cases for a key of type ``kind``: a wrong type, and out-of-range numbers."""
    base = _strip_optional(kind)
    if base in (int, float):
        cases = [("wrong type", "abc"), ("negative", -7)]
        if rule_problem(rule, 0):
            cases.append(("zero", 0))
        return cases
    if base is bool:
        return [("wrong type", "maybe")]
    if base is str:
        return [("wrong type", [1, 2])] + ([("not an option", "no_such_option")] if "choices" in rule else [])
    if base is Any:  # union-like keys (loss.chunk_tokens=auto|N, limit_val_batches=N|fraction)
        return [("wrong type", [1, 2]), ("negative", -7)]
    return [("wrong type", "abc")]  # lists and mappings


def _strip_optional(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if is_union(kind) and len(args) == 1:
        return args[0]
    return typing.get_origin(kind) or kind


def _rule(path: str, value_cfg: DictConfig) -> dict[str, Any]:
    """The key(...) rule of a dotted path, through _target_ nodes too."""
    import dataclasses

    parts = path.split(".")
    schema: Any = schema_of(value_cfg)
    node: Any = OmegaConf.to_container(value_cfg, resolve=False)
    for i, part in enumerate(parts):
        if isinstance(node, dict) and "_target_" in node and node["_target_"] in TARGET_SCHEMAS and i > 0:
            schema = TARGET_SCHEMAS[node["_target_"]]
        fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        if part in fields and i == len(parts) - 1:
            return fields[part].metadata.get("rule", {})
        if part in fields:
            schema = typing.get_type_hints(schema)[part]
        node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and "_target_" in node and node["_target_"] in TARGET_SCHEMAS:
            schema = TARGET_SCHEMAS[node["_target_"]]
    return {}


def own_keys(option: str | None, leaves: dict[str, Any]) -> list[str]:
    """The keys an option contributes: the whole tree for the default config, else its group's subtree."""
    if option is None:
        return sorted(leaves)
    group = option.split("=")[0].lstrip("+")
    if group == "recipe":
        return []
    return sorted(k for k in leaves if k == group or k.startswith(group + "."))


@pytest.mark.parametrize("option", OPTIONS)
def test_every_yaml_key_has_a_schema_line(option):
    """A key added to a yaml file without its field (its component's settings dataclass, or
    lit_titan/config/schema.py) fails here, by name."""
    cfg = composed(option)  # compose() itself refuses an unknown key: "<key>=<value>: not a config key"
    missing = [k for k, kind in schema_leaves(cfg).items() if kind is None]
    assert not missing, f"{option}: keys without a field in a settings dataclass or schema.py: {missing}"


@pytest.mark.parametrize("option", [None, *[o for o in OPTIONS if not o.startswith("+recipe")]])
def test_every_leaf_key_refuses_a_bad_value_in_one_line(option):
    cfg = composed(option)
    leaves = schema_leaves(cfg)
    if option is None:  # keys no yaml of ours sets (cluster.partition, ...) are fuzzed too
        leaves = {**field_types(schema_of(cfg)), **leaves}
    keys = own_keys(option, leaves)
    assert keys, f"{option}: no keys found"
    failures, cases = [], 0
    for path in keys:
        for what, value in bad_values(leaves[path], _rule(path, cfg)):
            bad = copy.deepcopy(cfg)
            OmegaConf.update(bad, path, value, merge=False, force_add=True)
            start = time.process_time()  # CPU time: a loaded machine stretches wall time, not this
            cases += 1
            try:
                validate(bad)
            except ConfigError as err:
                line = str(err)
                if not line.startswith(f"{path}=") or "\n" in line or "; " not in line:
                    failures.append(f"{path}={value!r} ({what}): message {line!r}")
            except Exception as err:  # noqa: BLE001 - anything else is the traceback the issue is about
                failures.append(f"{path}={value!r} ({what}): {type(err).__name__}: {err}")
            else:
                failures.append(f"{path}={value!r} ({what}): accepted")
            assert time.process_time() - start < 10, f"{path}={value!r} took over 10 s of CPU"
    assert not failures, f"{option}: {len(failures)} of {cases} cases:\n" + "\n".join(failures)


def test_an_unknown_key_is_refused_at_compose_time_naming_it():
    with pytest.raises(ConfigError, match=r"^model\.sliding_windw=4: not a config key; .*n_layers"):
        compose(["+model.sliding_windw=4"], check=True)
    with pytest.raises(ConfigError, match=r"^callbacks\.float8\.recipee=rowwise: not a config key"):
        compose(["callbacks=[float8]", "+callbacks.float8.recipee=rowwise"], check=True)


def test_a_bad_value_is_named_where_it_was_set_not_where_it_is_used():
    # optim.total_steps is ${trainer.max_steps}: the message names the key the user wrote
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.max_steps=abc: wrong type; trainer\.max_steps takes an "
        r"integer$",
    ):
        compose(["trainer.max_steps=abc"], check=True)


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "checkpoint=false",
            "checkpoint=false: checkpoint is a group of settings; did you mean checkpoint.enabled=false?",
        ),
        ("preflight=true", "preflight=true: preflight is a group of settings; did you mean preflight.enabled=true?"),
        ("loss=0", "loss=0: loss is a group of settings; did you mean loss.chunk_tokens=0?"),
        ("trainer=10", "trainer=10: trainer is a group of settings; set one of its keys instead (trainer.max_steps, "),
    ],
)
def test_a_group_replaced_by_a_value_names_the_key_meant(override, line):
    with pytest.raises(ConfigError) as info:
        compose([override], check=True)
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)


def test_a_config_group_given_a_number_lists_its_options(tmp_path):
    from lit_titan.train import main

    with pytest.raises(
        ConfigError,
        match=r"^data=3: data is a config group; choose one of mixture, stdlib, text, "
        r"tokens \(or set one of its keys: data\.KEY=VALUE\)$",
    ):
        main(["data=3", f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_a_users_own_target_is_checked_against_its_signature():
    with pytest.raises(
        ConfigError,
        match=r"^callbacks\.mine\.nope=1: lightning\.pytorch\.callbacks\.Timer takes "
        r"no argument 'nope'",
    ):
        compose(["+callbacks.mine._target_=lightning.pytorch.callbacks.Timer", "+callbacks.mine.nope=1"], check=True)
    compose(["+callbacks.mine._target_=lightning.pytorch.callbacks.Timer", "+callbacks.mine.interval=step"], check=True)


def test_each_group_of_ours_is_its_components_settings():
    """Each key declared once: a group, or a callback node of ours, is the very dataclass its component
    takes (from the torch-free settings module beside it), with its choices and ranges; no copy in
    schema.py to keep equal. Declared in schema.py: the job's top-level keys and the keys of Lightning's
    loggers and profilers; the model group is built from the family's arguments dataclass (model_schema)."""
    import dataclasses
    import importlib
    import inspect

    from lit_titan.config import schema

    hints = typing.get_type_hints(schema.TrainSchema)
    groups = {name: kind for name, kind in hints.items() if dataclasses.is_dataclass(kind)}
    in_schema = sorted(name for name, kind in groups.items() if kind.__module__ == schema.__name__)
    assert in_schema == [], f"groups declared in schema.py instead of beside their component: {in_schema}"
    assert all(kind.__module__.endswith(".settings") for kind in groups.values())
    assert "model" not in groups and schema.train_schema("llama3_debug").__dataclass_fields__["model"].type
    callbacks = {t: kind for t, kind in TARGET_SCHEMAS.items() if t.startswith("lit_titan.callbacks.")}
    assert len(callbacks) == 9
    for target, kind in callbacks.items():
        module, _, name = target.rpartition(".")
        settings = inspect.signature(getattr(importlib.import_module(module), name)).parameters["settings"]
        assert kind.__module__ == "lit_titan.callbacks.settings" and kind.__name__ in str(settings.annotation)


def test_every_option_of_every_group_is_covered():
    groups = {p.name for p in Path(conf_dir()).iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")}
    assert groups == {*GROUPS, "recipe"}, (
        "a new config group needs its schema (lit_titan/config/schema.py) and GROUPS here"
    )


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["cluster.devices=4", "parallel.dp_shard=3"], "parallel.dp_shard=3: the degrees"),
        (
            ["cluster.devices=4", "parallel.tp=4", "model.dim=96", "model.n_heads=6", "model.n_kv_heads=6"],
            "parallel.tp=4: does not divide the model's n_heads=6; use parallel.tp in [1, 2, 3, 6]",
        ),
        (
            ["cluster.devices=2", "parallel.tp=2", "data.seq_len=33"],
            "data.seq_len=33: not divisible by tp=2; use a multiple of 2, e.g. data.seq_len=32",
        ),
        (
            ["data.seq_len=4096"],
            "data.seq_len=4096: exceeds the maximum sequence length 2048 of llama3_debug; use data.seq_len<=2048",
        ),
        (
            ["model.vocab_size=512", "data.tokenizer.vocab_size=1024"],
            "data.tokenizer.vocab_size=1024: larger than model.vocab_size=512",
        ),
        (["model.dim=100", "model.n_heads=3"], "model.dim=100: must be divisible by model.n_heads=3"),
        (["fault.kill_rank=0"], "fault.at_step=null: fault.kill_rank=0 needs the step to fail at; set fault.at_step=N"),
        (["fault.kill_rank=0", "fault.at_step=500"], "fault.at_step=500: after the run's last step"),
        (
            ["cluster.devices=2", "fault.kill_rank=2", "fault.at_step=1"],
            "fault.kill_rank=2: not a rank of this 2-process job; use 0..1",
        ),
        (
            ["fault.kill_rank=0", "fault.at_step=2", "fault.stage_error=ENOMEM", "checkpoint.async_save=false"],
            "fault.stage_error=ENOMEM: only asynchronous saves stage a copy",
        ),
        (["callbacks=[profiler]", "callbacks.profiler.steps=[3,400]"], "callbacks.profiler.steps=[3, 400]: ends after"),
        (
            ["cluster.devices=2", "parallel.pp=2", "parallel.pp_microbatches=3"],
            "parallel.pp_microbatches=3: the per-rank",
        ),
    ],
)
def test_cross_key_rules_name_the_key_and_the_valid_values(overrides, line):
    with pytest.raises(ValueError) as info:  # ConfigError or LayoutError, both one line
        validate(compose(overrides))
    assert str(info.value).startswith(line) and "\n" not in str(info.value) and "; " in str(info.value), str(info.value)


def documented_commands() -> list[str]:
    """``python -m lit_titan.train`` / ``lit-titan train|plan ...`` lines of README.md and docs/configuration.md (single runs)."""
    import re

    root = ROOT
    out = []
    for doc in ("README.md", "docs/configuration.md"):
        text = (root / doc).read_text().replace("\\\n", " ")
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.splitlines():
                line = line.split("#")[0].strip()
                prefix = next(
                    (
                        p
                        for p in ("python -m lit_titan.train", "lit-titan train", "lit-titan plan")
                        if line.startswith(p + " ")
                    ),
                    None,
                )
                if (
                    prefix
                    and not any(flag in line.split()[len(prefix.split()) :] for flag in ("-m", "--cfg"))
                    and not any(key in line for key in (" search=", " calibrate="))
                ):  # many layouts / none
                    out.append(line)
    return out


@pytest.mark.parametrize("command", documented_commands())
def test_documented_commands_pass_the_schema_and_validation(command):
    import shlex

    words = shlex.split(command)
    args = [a for a in words[3 if words[0] == "python" else 2 :] if not a.startswith("--")]
    if words[:2] == ["lit-titan", "plan"]:
        from lit_titan.cli.plan import split_plan_keys

        args = split_plan_keys(args)[1]  # the planner's own keys (search=true ...) are not config keys
    cfg = compose(args)
    if "model.init_from_hf=hf/my-llama" not in args:  # a placeholder directory: the schema check only
        validate(cfg)


def test_the_documented_commands_were_found():
    assert len(documented_commands()) >= 6
