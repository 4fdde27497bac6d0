"""A CPU rank's thread count: OMP_NUM_THREADS first, else the process's own CPUs shared by the local ranks."""

from __future__ import annotations

import os

import pytest

from lit_titan.strategies import host_threads
from lit_titan.strategies.host_threads import cpu_threads


def test_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(4) == 3


@pytest.mark.parametrize("env", [None, "", "0", "auto"])
def test_affinity_not_host_count_shared_by_local_ranks(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(os, "cpu_count", lambda: 256)  # the host: not what this process may use
    monkeypatch.setattr(host_threads, "_usable_cpus", lambda: {0, 1, 2, 3, 4, 5, 6, 7})
    assert cpu_threads(2) == 4
    assert cpu_threads(16) == 1  # never 0


def test_usable_cpus_is_the_affinity_where_exposed():
    if hasattr(os, "sched_getaffinity"):
        assert host_threads._usable_cpus() == os.sched_getaffinity(0)
    else:
        assert len(host_threads._usable_cpus()) == (os.cpu_count() or 1)
