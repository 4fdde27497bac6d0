"""``python -m lit_titan.plan [hydra overrides]``: dry-run a layout for a cluster profile, no accelerator.

Takes the same overrides as ``lit_titan.train`` (e.g. ``+recipe=llama3_405b_h100_512``), builds the
model on the meta device and applies the training parallelisation (``TitanStrategy.parallelize``)
over a fake process group of the profile's world size, then reports rank 0's parameter, gradient,
optimizer and activation memory against the profile's HBM, FLOPs per token, an estimated step time
and MFU bound, and every reason the layout cannot work. Writes ``${run_dir}/plan.json``.

    python -m lit_titan.plan +recipe=llama3_405b_h100_512
    python -m lit_titan.plan model=llama3_8b cluster=h100_8 data.seq_len=8192 data.global_batch_size=16
    python -m lit_titan.plan --launch +recipe=llama3_70b_h100_256   # print the launch command instead
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from lit_titan.config import ConfigError, compose
from lit_titan.planner import launch_command, make_plan_from_cfg, render_table

__all__ = ["make_plan", "main"]


def make_plan(overrides: list[str] | tuple[str, ...] = (), *, write: bool = True) -> dict[str, Any]:
    """Compose the config from ``overrides`` (as ``lit_titan.train`` does) and return the plan dict.

    With ``write`` the plan also goes to ``${run_dir}/plan.json`` (``run_dir=null``: runs/<model>-plan-<time>);
    its path is ``plan["plan_path"]``.
    """
    cfg = compose(list(overrides))
    plan = make_plan_from_cfg(cfg, overrides=list(overrides))
    if write:
        run_dir = Path(str(cfg.run_dir)) if cfg.get("run_dir") else (
            Path("runs") / f"{cfg.model.name}-plan-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir = run_dir.expanduser().resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "plan.json"
        plan["plan_path"] = str(path)
        path.write_text(json.dumps(plan, indent=2, default=str) + "\n")
    return plan


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return {}
    if argv[:1] == ["--launch"]:
        print(launch_command(compose(argv[1:]), argv[1:]))
        return {}
    plan = make_plan(argv)
    print(render_table(plan))
    return plan


if __name__ == "__main__":
    from lit_titan.cli import run_entry_point

    run_entry_point(main, (ConfigError,))
