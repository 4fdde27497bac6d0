"""The default process group under torchrun, in a store namespace every node agrees is new.

Why this exists (torch 2.11-2.15, c10d rendezvous): torchrun's agents share one TCPStore with
their workers (hosted by the agent of node rank 0, ``TORCHELASTIC_USE_AGENT_STORE``) and keep it
across restarts, while ``env://`` keys the workers' gloo rendezvous identically in every attempt:
a restarted rank can read a dead rank's address and fail in gloo's ``connectFullMesh`` ("Connection
refused"). Namespacing by ``TORCHELASTIC_RESTART_COUNT`` fixes one agent but not several: an
agent restarts its workers either because one of them failed (the count goes up) or because
another node re-joined the rendezvous (``num_nodes_waiting``; "membership changes do not count as
retries", the count stays). After a rank on node 1 dies, node 0's count may stay 0 while node 1's
becomes 1, so the two halves of the job rendezvous under different names (seen: node 0's ranks
read attempt 0's keys and failed; the job then survived only by chance).

What every rank does agree on: every attempt restarts every worker of every node, once. So each
rank counts its own starts in the store (``add``, atomic) and the count is the attempt number, the
same on every node; the process group rendezvous under ``lit_titan/attempt_<n>/``.
Limit: a rank that dies before reaching this point (during start-up) misses one count; the next
attempt then fails at the process-group timeout instead of joining (its peers use a newer name).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

START_KEY = "lit_titan/starts/rank{rank}"
NAMESPACE = "lit_titan/attempt_{attempt}/"


def under_torchelastic() -> bool:
    """Started by a torchrun agent (its env), not by Lightning's launcher or a test harness."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_PORT" in os.environ and "RANK" in os.environ


def init_process_group(backend: str, timeout: timedelta, device_id=None) -> int:
    """Join the job's default process group in this attempt's namespace; returns the attempt (0 = first)."""
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # With the agent's shared store every worker is a client; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # rank 0 hosts a new store per attempt at MASTER_PORT (then the count is always 1: nothing stale).
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=hosts, timeout=timeout
    )
    attempt = store.add(START_KEY.format(rank=rank), 1) - 1
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(NAMESPACE.format(attempt=attempt), store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return attempt
