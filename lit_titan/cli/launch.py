"""``lit-titan launch [--dry-run] [overrides]``: the command that starts ``lit_titan.train`` on a cluster profile.

Prints (``--dry-run``) or runs it: ``torchrun`` (run on every node; several nodes meet at
``$MASTER_ADDR``), or an sbatch script with ``srun`` under Slurm (one task per device; Lightning's
SLURMEnvironment / TorchElasticEnvironment pick the ranks up), which is printed for ``sbatch``. The
config is checked first, so a profile or layout that cannot work fails here, not on the fleet
(docs/launching.md).

- ``cluster.launcher: torchrun``: one ``torchrun`` agent per node. On one node it picks a free
  rendezvous port; on several, every node runs the same line and finds node 0 through
  ``$MASTER_ADDR`` (c10d rendezvous), so the line holds a ``$`` and runs under ``bash -c``.
- ``cluster.launcher: srun``: an sbatch script whose ``srun`` starts one task per device on every
  node; Lightning's ``SLURMEnvironment`` reads the ranks from ``SLURM_*``. The script restarts the
  job (a new ``srun``) up to ``cluster.max_restarts`` times, each attempt resuming from the newest
  checkpoint, and pins ``run_dir`` to the Slurm job id so that every task and attempt agrees on it.

Ranks are node-major (torchrun and srun both number a node's ranks consecutively), and the mesh's
inner dims (``dp_shard``, ``cp``, ``tp``) vary fastest, so a layout with ``dp_shard*cp*tp`` equal to
the devices per node puts ``dp_replicate`` across nodes and everything else inside one
(docs/launching.md, "Multi-node").
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

from omegaconf import DictConfig

from lit_titan.cli.store import DEFAULT_PORT
from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError
from lit_titan.job.settings import LAUNCHERS, ClusterConfig
from lit_titan.strategies.parallel_dims import LayoutError

DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def check_cluster(cfg: DictConfig) -> None:
    """Refuse a profile whose nodes x devices cannot run the layout: one line naming the setting.

    Checked before anything is printed or started (``lit-titan launch``, ``lit-titan plan --launch``).
    """
    c, p = cfg.cluster, cfg.parallel
    launcher = c.get("launcher", ClusterConfig().launcher)
    if launcher not in LAUNCHERS:
        raise ConfigError(f"cluster.launcher={launcher}: not an option; choose one of {', '.join(LAUNCHERS)}")
    nodes, per_node = int(c.num_nodes), int(c.devices)
    if nodes < 1 or per_node < 1:
        raise ConfigError(f"cluster.num_nodes={nodes} and cluster.devices={per_node} must both be >= 1")
    gpus = c.get("gpus_per_node")
    if c.accelerator == "gpu" and gpus is not None and per_node > int(gpus):
        raise ConfigError(
            f"cluster.devices={per_node} processes per node, but the profile's nodes have "
            f"cluster.gpus_per_node={gpus} GPUs; set cluster.devices={gpus} (one process per GPU) "
            f"and raise cluster.num_nodes instead"
        )
    degrees = {k: int(p[k]) for k in DEGREES}
    if degrees["dp_shard"] != -1:
        product = 1
        for v in degrees.values():
            product *= v
        if product != nodes * per_node:
            shown = "*".join(f"{k}={v}" for k, v in degrees.items())
            raise ConfigError(
                f"cluster has {nodes} node(s) x {per_node} device(s) = {nodes * per_node} processes but the layout "
                f"{shown} needs {product}; set cluster.num_nodes / cluster.devices to match, or "
                f"parallel.dp_shard=-1 to take the ranks left"
            )


def launches_per_replica_group(cfg: DictConfig) -> bool:
    """Fault tolerance under torchrun: one agent per replica group (``replica_group_commands``)."""
    launcher = cfg.cluster.get("launcher", ClusterConfig().launcher)
    return bool((cfg.get("fault_tolerance") or {}).get("enabled")) and launcher == "torchrun"


def replica_group_commands(cfg: DictConfig, overrides: list[str]) -> str:
    """Under ``fault_tolerance.enabled=true`` with torchrun: the job's store, then one torchrun agent per
    replica group (whole nodes each), so an agent restarts only its own group, which rejoins the others.

    No ``resume=auto``: a restarted group takes a live peer's state, and a checkpoint loaded over it is
    refused (docs/fault_tolerance.md, "Launching one torchrun per replica group").
    """
    c, replicas = cfg.cluster, int(cfg.parallel.dp_replicate)
    nodes, per_node, restarts = int(c.num_nodes), int(c.devices), int(c.get("max_restarts", 3))
    if nodes % replicas:
        raise ConfigError(
            f"cluster.num_nodes={nodes}: one torchrun per replica group needs whole nodes per group, and "
            f"parallel.dp_replicate={replicas} groups do not divide them; set cluster.num_nodes to a multiple of "
            f"{replicas}"
        )
    keys = {o.split("=", 1)[0].lstrip("+~"): o for o in overrides}
    for key in ("fault_tolerance.replica_id", "fault_tolerance.store"):
        if key in keys:
            raise ConfigError(f"{keys[key]}: each group's line sets it (REPLICA, LIT_TITAN_STORE); leave it out here")
    if "run_dir" not in keys:  # every group and every restart writes to the same run_dir
        overrides = [*overrides, f"run_dir=runs/{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    args = " ".join(shlex.quote(o) for o in overrides)
    group_nodes = nodes // replicas
    if group_nodes == 1:  # a group is one node: its agent alone, on a free port
        rdzv = "--rdzv_endpoint=localhost:0"
    else:  # the group's nodes meet at its first node
        rdzv = '--rdzv_endpoint="${GROUP_ADDR:?set GROUP_ADDR to the first node of this replica group}:29500" '
        rdzv += '--rdzv_id="lit-titan-group$REPLICA"'
    return "\n".join(
        [
            "# fault_tolerance.enabled=true: one torchrun agent per replica group; an agent restarts only its own",
            '# group, which rejoins the others (docs/fault_tolerance.md, "Launching one torchrun per replica group").',
            "# 1. The job's store, for the whole job, on a host that outlives the groups (e.g. the login node):",
            f"python -m lit_titan.cli store --port {DEFAULT_PORT}",
            f"# 2. On each node of replica group REPLICA (0..{replicas - 1}; {group_nodes} node(s) each), with "
            f"LIT_TITAN_STORE=<that host>:{DEFAULT_PORT}:",
            f"torchrun --nnodes={group_nodes} --nproc_per_node={per_node} --max-restarts={restarts} "
            f"--rdzv_backend=c10d {rdzv} -m lit_titan.train {args} "
            '"fault_tolerance.replica_id=${REPLICA:?set REPLICA to this replica group}" '
            '"fault_tolerance.store=${LIT_TITAN_STORE:?set LIT_TITAN_STORE to HOST:PORT of the store}"',
        ]
    )


def launch_command(cfg: DictConfig, overrides: list[str]) -> str:
    """The command (torchrun) or sbatch script (srun) that starts training on the profile.

    Both restart a failed job up to ``cluster.max_restarts`` times (default 3) with ``resume=auto``,
    so each attempt continues from the newest complete checkpoint (docs/fault_tolerance.md). Under
    ``fault_tolerance.enabled=true`` with torchrun: one agent per replica group (``replica_group_commands``).
    """
    check_cluster(cfg)
    c = cfg.cluster
    if launches_per_replica_group(cfg):
        return replica_group_commands(cfg, overrides)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if "resume" not in keys:
        overrides = [*overrides, "resume=auto"]
    if c.get("launcher", ClusterConfig().launcher) == "torchrun" and "run_dir" not in keys:
        # Every node (and every restart) must write to the same run_dir; torchrun's run id defaults
        # to "none", so pin it here: running the printed line again continues this job (resume=auto).
        overrides = [*overrides, f"run_dir=runs/{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    args = " ".join(shlex.quote(o) for o in overrides)
    nodes, per_node, restarts = int(c.num_nodes), int(c.devices), int(c.get("max_restarts", 3))
    if c.get("launcher", ClusterConfig().launcher) == "srun":
        # Each srun task composes its own run directory: without run_dir= they would disagree, and a
        # later attempt would not find the checkpoints to resume from. Double quotes: $SLURM_JOB_ID expands.
        run_dir = "" if "run_dir" in keys else f' "run_dir=runs/{cfg.model.name}-$SLURM_JOB_ID"'
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name=lit-titan-{cfg.model.name}",
            f"#SBATCH --nodes={nodes}",
            f"#SBATCH --ntasks-per-node={per_node}",  # Lightning's SLURMEnvironment: one task per device
        ]
        if c.accelerator == "gpu":  # a CPU partition has no GPUs to ask for: Slurm would refuse the job
            lines.append(f"#SBATCH --gpus-per-node={per_node}")
        lines += [
            "#SBATCH --exclusive",
            "# run_dir must be on a shared filesystem: every attempt resumes from its checkpoints",
            f"for attempt in $(seq 0 {restarts}); do",
            f"  LIT_TITAN_ATTEMPT=$attempt srun --kill-on-bad-exit=1 python -m lit_titan.train {args}{run_dir} "
            "&& exit 0",
            "done",
            "exit 1",
        ]
        return "\n".join(lines)
    head = f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --max-restarts={restarts} --rdzv_backend=c10d"
    if nodes == 1:  # port 0: the agent picks a free one, so two jobs on one machine do not collide
        return f"{head} --rdzv_endpoint=localhost:0 -m lit_titan.train {args}".rstrip()
    # Every node runs this same line; node 0's address comes from the environment (bash expands it).
    endpoint = "${MASTER_ADDR:?set MASTER_ADDR to node 0}:${MASTER_PORT:-29500}"
    return f"{head} --rdzv_endpoint={endpoint} --rdzv_id=lit-titan -m lit_titan.train {args}".rstrip()


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from lit_titan.cli.usage import render

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
    elif launches_per_replica_group(cfg):
        print(command)
        print("\n# start the store, then run the torchrun line on every node of each replica group", file=sys.stderr)
    elif cfg.cluster.get("launcher", ClusterConfig().launcher) == "srun":
        print(command)
        print("\n# save this as a script and submit it with sbatch", file=sys.stderr)
    else:
        if int(cfg.cluster.num_nodes) > 1 and not os.environ.get("MASTER_ADDR"):
            raise ConfigError(
                f"cluster.num_nodes={cfg.cluster.num_nodes}: set MASTER_ADDR to node 0's address and "
                f"run this same command on every node (or --dry-run to print it)"
            )
        # bash, not shlex.split: the multi-node line reads $MASTER_ADDR / $MASTER_PORT.
        sys.exit(subprocess.run(["bash", "-c", command]).returncode)
    return command


if __name__ == "__main__":
    from lit_titan.cli.entry import run_entry_point

    run_entry_point(main, (ConfigError, LayoutError))
