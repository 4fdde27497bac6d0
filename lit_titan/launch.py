"""``python -m lit_titan.launch [--dry-run] [overrides]`` (or ``lit-titan launch``).

Prints (``--dry-run``) or runs the command that starts ``lit_titan.train`` on the cluster
profile: ``torchrun`` (run on every node; several nodes meet at ``$MASTER_ADDR``), or an sbatch
script with ``srun`` under Slurm (one task per device; Lightning's SLURMEnvironment /
TorchElasticEnvironment pick the ranks up), which is printed for ``sbatch``. The config is checked
first, so a profile or layout that cannot work fails here, not on the fleet. What each command
does: ``lit_titan/planner/launch.py`` and docs/launching.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

from lit_titan.config import ConfigError, compose, validate
from lit_titan.planner import check_cluster, launch_command
from lit_titan.strategies.parallel_dims import LayoutError


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from lit_titan.usage import render

        print(render("launch", intro=__doc__.strip()))
        return ""
    dry_run = "--dry-run" in argv
    overrides = [a for a in argv if a != "--dry-run"]
    cfg = compose(overrides)
    check_cluster(cfg)  # the profile against the layout first: its message names the cluster keys
    validate(cfg)
    command = launch_command(cfg, overrides)
    if dry_run:
        print(command)
    elif cfg.cluster.get("launcher", "torchrun") == "srun":
        print(command)
        print("\n# save this as a script and submit it with sbatch", file=sys.stderr)
    else:
        if int(cfg.cluster.num_nodes) > 1 and not os.environ.get("MASTER_ADDR"):
            raise ConfigError(f"cluster.num_nodes={cfg.cluster.num_nodes}: set MASTER_ADDR to node 0's address and "
                              f"run this same command on every node (or --dry-run to print it)")
        # bash, not shlex.split: the multi-node line reads $MASTER_ADDR / $MASTER_PORT.
        sys.exit(subprocess.run(["bash", "-c", command]).returncode)
    return command


if __name__ == "__main__":
    from lit_titan.cli import run_entry_point

    run_entry_point(main, (ConfigError, LayoutError))
