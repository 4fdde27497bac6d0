"""One launch per replica group: which group a process is in, and where the job's store is.

With one launcher for the whole job (one torchrun, one srun step), the launcher restarts every rank
when one dies. Launched per replica group (one torchrun agent per group, ``--max-restarts`` > 0), a
launcher restarts only its own group, which rejoins the others; its ranks are numbered inside the group
(torchrun's ``RANK``/``WORLD_SIZE``), so the group comes from ``fault_tolerance.replica_id``, and the
store every group meets in (``fault_tolerance.store``) is hosted by none of them (``lit-titan store``):
a per-group agent's store ends with its group's agent. The config rule on these keys is
``config/rules.py: replica_launch``.
"""

from __future__ import annotations

import os

from lit_titan.errors import ConfigError


def launch_world() -> int | None:
    """Processes this launch started (torchrun's ``WORLD_SIZE``, an srun step's ``SLURM_NTASKS``); None: unknown."""
    value = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    return int(value) if value else None


def check_launch(replica_id: int | None, launched: int | None, job_world: int, group_size: int) -> None:
    """The launch holds the whole job (no ``replica_id``) or one replica group (with it): one line otherwise,
    printed once per launch (every rank of it decides the same)."""
    try:
        _check_launch(replica_id, launched, job_world, group_size)
    except ConfigError as err:
        err.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise


def _check_launch(replica_id: int | None, launched: int | None, job_world: int, group_size: int) -> None:
    if launched is None or launched == job_world == group_size:
        return
    if replica_id is None and launched == group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id=null: this launch started {launched} of the job's {job_world} processes "
            f"(one replica group); give each group's launch fault_tolerance.replica_id=0..{job_world // group_size - 1} "
            "and fault_tolerance.store=HOST:PORT"
        )
    if replica_id is not None and launched == job_world:
        raise ConfigError(
            f"fault_tolerance.replica_id={replica_id}: this launch started all {job_world} processes of the job; "
            f"drop fault_tolerance.replica_id, or launch each replica group ({group_size} processes) on its own"
        )
    if launched not in (job_world, group_size):
        raise ConfigError(
            f"fault_tolerance.enabled=true: this launch started {launched} processes, but the job has {job_world} "
            f"(cluster.devices x cluster.num_nodes) in replica groups of {group_size}; launch them all at once, or "
            "each group on its own with fault_tolerance.replica_id"
        )


def job_rank(launch_rank: int, group_size: int, replica_id: int | None) -> int:
    """The rank in the whole job: the launch's rank, or with one launch per group, the group's rank in it."""
    return launch_rank if replica_id is None else replica_id * group_size + launch_rank % group_size


def store_address(store: str | None = None) -> tuple[str, int]:
    """The job's store: ``fault_tolerance.store``, else ``MASTER_ADDR:MASTER_PORT`` (one launch for the job)."""
    if store:
        host, _, port = store.rpartition(":")
        return host, int(port)
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
