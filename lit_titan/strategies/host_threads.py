"""How many intra-op threads a CPU rank takes: the user's and the launcher's choice first."""

from __future__ import annotations

import os


def cpu_threads(local_processes: int) -> int:
    """``OMP_NUM_THREADS`` when set (the user's or torchrun's), else this process's CPUs / local ranks.

    The process's CPU affinity, not the host's count: under a cgroup, ``taskset`` or a Slurm
    allocation ``os.cpu_count()`` overstates the cores, and oversubscribed ranks run many times slower.
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(_usable_cpus()) // max(local_processes, 1))


def _usable_cpus() -> set[int] | range:
    """The CPUs this process may run on (all of them where affinity is not exposed, e.g. macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return range(os.cpu_count() or 1)
