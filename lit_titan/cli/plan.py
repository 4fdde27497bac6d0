"""``lit-titan plan [hydra overrides]``: dry-run a layout for a cluster profile, no accelerator.

Takes the same overrides as ``lit_titan.train`` (e.g. ``+recipe=llama3_405b_h100_512``), builds the
model on the meta device and applies the training parallelisation (``TitanStrategy.parallelize``)
over a fake process group of the profile's world size, then reports rank 0's parameter, gradient,
optimizer and activation memory against the profile's HBM, FLOPs per token, an estimated step time
and MFU bound, and every reason the layout cannot work. Writes ``${run_dir}/plan.json``.

    lit-titan plan +recipe=llama3_405b_h100_512
    lit-titan plan model=llama3_8b cluster=h100_8 data.seq_len=8192 data.global_batch_size=16
    lit-titan plan --launch +recipe=llama3_70b_h100_256   # print the launch command instead
    lit-titan plan search=true model=llama3_405b cluster=h100_512 data.seq_len=8192 data.global_batch_size=256
    lit-titan plan calibrate=runs/my-run                             # fit efficiencies -> runs/my-run/calibration.yaml
    lit-titan plan search=true plan.calibration=runs/my-run/calibration.yaml ...

Planner keys (read here, not by Hydra, so training's config stays as it is): search=true|false,
calibrate=RUN_DIR, plan.calibration=FILE, plan.top=N (rows, 10), plan.confirm=K (top layouts built, 3),
plan.expert_imbalance=X (MoE: max/mean tokens per expert, 1.0; the run report's expert-load figure measures it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from lit_titan.cli.launch import launch_command
from lit_titan.config import ConfigError, compose
from lit_titan.planner import make_plan_from_cfg, render_table

__all__ = ["make_plan", "main"]


PLAN_KEYS = ("search", "calibrate", "plan.calibration", "plan.top", "plan.confirm", "plan.expert_imbalance")


def split_plan_keys(overrides: list[str] | tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """The planner's own keys (PLAN_KEYS) apart from the training overrides they came with."""
    mine, rest = {}, []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        if key in PLAN_KEYS and "=" in o:
            mine[key] = o.split("=", 1)[1]
        else:
            rest.append(o)
    return mine, rest


def _efficiencies(keys: dict[str, str]):
    from lit_titan.planner.calibrate import load_calibration
    from lit_titan.planner.estimate import with_expert_imbalance

    eff = load_calibration(keys["plan.calibration"]) if keys.get("plan.calibration") else None
    return with_expert_imbalance(eff, keys.get("plan.expert_imbalance"))


def make_plan(overrides: list[str] | tuple[str, ...] = (), *, write: bool = True) -> dict[str, Any]:
    """Compose the config from ``overrides`` (as ``lit_titan.train`` does) and return the plan dict.

    With ``write`` the plan also goes to ``${run_dir}/plan.json`` (``run_dir=null``: runs/<model>-plan-<time>);
    its path is ``plan["plan_path"]``. ``plan.calibration=FILE`` among them: its efficiencies.
    """
    keys, overrides = split_plan_keys(overrides)
    eff = _efficiencies(keys)
    cfg = compose(list(overrides), check=True)
    plan = make_plan_from_cfg(cfg, overrides=list(overrides), eff=eff, schema_checked=True)
    if write:
        plan["plan_path"] = str(_write(cfg, "plan.json", plan))
    return plan


def search_layouts(overrides: list[str] | tuple[str, ...] = (), *, write: bool = True) -> dict[str, Any]:
    """``search=true``: rank every valid layout (lit_titan.planner.search); writes ``search.json``."""
    from lit_titan.planner.search import search

    keys, overrides = split_plan_keys(overrides)
    cfg = compose(list(overrides), check=True)
    result = search(
        cfg,
        list(overrides),
        eff=_efficiencies(keys),
        top=int(keys.get("plan.top", 10)),
        confirm=int(keys.get("plan.confirm", 3)),
    )
    if write:
        result["path"] = str(_write(cfg, "search.json", result))
    return result


def _write(cfg, name: str, obj: dict[str, Any]) -> Path:
    run_dir = (
        Path(str(cfg.run_dir))
        if cfg.get("run_dir")
        else (Path("runs") / f"{cfg.model.name}-plan-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    run_dir = run_dir.expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / name
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from lit_titan.cli.usage import render

        print(render("plan", intro=__doc__.strip(), examples=False))  # the examples are in the docstring
        return {}
    if argv[:1] == ["--launch"]:
        print(launch_command(compose(argv[1:], check=True), argv[1:]))
        return {}
    keys, _ = split_plan_keys(argv)
    if keys.get("calibrate"):
        from lit_titan.planner.calibrate import calibrate_run

        cal = calibrate_run(keys["calibrate"], out=keys.get("plan.calibration"))
        print(f"calibrated from {keys['calibrate']}: {cal['efficiencies']}\nwrote {cal['path']}")
        return cal
    if keys.get("search", "false").lower() in ("true", "1", "yes"):
        from lit_titan.planner.search import render_search

        result = search_layouts(argv)
        print(render_search(result) + f"\nwrote {result['path']}")
        return result
    plan = make_plan(argv)
    print(render_table(plan))
    return plan


if __name__ == "__main__":
    from lit_titan.cli.entry import run_entry_point

    run_entry_point(main, (ConfigError,))
