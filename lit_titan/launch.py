"""``python -m lit_titan.launch [--dry-run] [overrides]`` (or ``lit-titan launch``).

Prints (``--dry-run``) or runs the command that starts ``lit_titan.train`` on the cluster
profile: ``torchrun`` on one node, an sbatch script with ``srun`` under Slurm (one task per GPU;
Lightning's SLURMEnvironment / TorchElasticEnvironment pick the ranks up). The config is checked
first, so a layout that cannot work fails here, not on the fleet.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

from lit_titan.config import ConfigError, compose, validate
from lit_titan.planner import launch_command
from lit_titan.strategies.parallel_dims import LayoutError


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in argv
    overrides = [a for a in argv if a != "--dry-run"]
    cfg = compose(overrides)
    validate(cfg)
    command = launch_command(cfg, overrides)
    if dry_run:
        print(command)
    elif cfg.cluster.get("launcher", "torchrun") == "srun":
        print(command)
        print("\n# save this as a script and submit it with sbatch", file=sys.stderr)
    else:
        subprocess.run(shlex.split(command), check=True)
    return command


if __name__ == "__main__":
    from lit_titan.cli import run_entry_point

    run_entry_point(main, (ConfigError, LayoutError))
