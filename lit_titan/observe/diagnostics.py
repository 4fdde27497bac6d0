"""Pre-flight diagnostics: find the slow rank or link before a job trains (MegaScale's diagnostic tests).

Every rank runs a short matmul burn-in (TFLOP/s, best of a few repeats, against the cluster
profile's peak where known) and times all-reduce and all-gather over each mesh group it belongs to
(one per mesh dim of size > 1: pp, dp_replicate, dp_shard, cp, tp) and over its node's groups:
``intra_node`` (the ranks of its node) and, with more than one node, ``inter_node`` (the ranks with
its local index on every node: the links between nodes). Nodes are the launcher's (Lightning's
``trainer.node_rank``: torchrun's GROUP_RANK, SLURM_NODEID, NODE_RANK). The results are gathered
on every rank, rank 0 writes ``run_dir/preflight.json``, and a rank whose burn-in, or a group whose
bandwidth, is below ``threshold`` x the median of its peers is named in one line, with its node and
host. ``action=stop`` then ends the job on every rank (exit code 2) before the model, a checkpoint
or a metrics file exists.

Noise: on a loaded host one timing can be several times off, and with two groups per dim the
median is the mean of the two. So a verdict is only kept when it holds ``confirm`` more times:
while anything is found, every rank measures again and each figure keeps its best (highest) value
over the rounds; a real fault is slow every round, a noisy link rarely twice.

The callback that runs them during training (before the model is built) is
``lit_titan.callbacks.preflight.Preflight``; ``fault.slow_rank`` is the drill (``measure``'s
``slow_factor``/``slow_link``).
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from lit_titan.errors import ConfigError


class PreflightFinished(Exception):
    """``preflight.only=true`` (``lit-titan preflight``): the diagnostics ran and found nothing to stop for."""


class PreflightError(RuntimeError):
    """``preflight.action=stop`` found a slow rank or link; raised on every rank together."""

    raised_on_every_rank = True  # the command line prints it once (rank 0)


def check_config(preflight: Any, fault: Any, world: int) -> None:
    """ConfigError naming the key when the slow-rank drill cannot run. What each key accepts on its own
    (``preflight.action``, ``threshold``, ``fault.slow_link``) is their settings' rule, checked before
    (``callbacks/settings.py``, the schema)."""
    if not preflight:
        return
    slow = fault.get("slow_rank") if fault else None
    link = fault.get("slow_link") if fault else None
    if link is not None and slow is None:
        raise ConfigError(f"fault.slow_link={link} slows a rank's links; set fault.slow_rank=RANK")
    if slow is not None:
        if not preflight.get("enabled"):
            raise ConfigError("fault.slow_rank slows a rank's pre-flight burn-in; set preflight.enabled=true")
        if not 0 <= int(slow) < world:
            raise ConfigError(f"fault.slow_rank={slow} is not a rank of this {world}-process job")
        if float(fault.get("slow_factor", 4.0)) < 1:
            raise ConfigError(f"fault.slow_factor={fault.get('slow_factor')} must be >= 1")


def burn_in(
    device: torch.device,
    *,
    n: int = 256,
    iters: int = 8,
    repeats: int = 3,
    slow_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Best matmul rate of ``repeats`` runs of ``iters`` [n, n] x [n, n] products, in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a = torch.mm(a, b).div_(n**0.5)
        _sync(device)
        elapsed = time.perf_counter() - t0
        if slow_factor > 1:  # the fault drill: this rank computes slow_factor times slower
            time.sleep(elapsed * (slow_factor - 1))
            elapsed *= slow_factor
        best = min(best, elapsed)
    return 2 * n**3 * iters / best / 1e12


def bandwidth(
    group: dist.ProcessGroup, device: torch.device, *, numel: int = 1 << 18, repeats: int = 5, slow_factor: float = 1.0
) -> dict[str, float]:
    """Bus bandwidth (GB/s, NCCL's convention) of all-reduce and all-gather of ``numel`` fp32 over ``group``.

    ``slow_factor`` > 1 is the link drill: this rank's view of each collective is that many times slower.
    """
    n = dist.get_world_size(group)
    x = torch.ones(numel, device=device)
    parts = [torch.empty(numel, device=device) for _ in range(n)]
    out = {}
    for name, op, factor in (
        ("all_reduce_gbps", lambda: dist.all_reduce(x, group=group), 2 * (n - 1) / n),
        ("all_gather_gbps", lambda: dist.all_gather(parts, x, group=group), (n - 1)),
    ):
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            op()
            _sync(device)
            elapsed = time.perf_counter() - t0
            if slow_factor > 1:
                time.sleep(elapsed * (slow_factor - 1))
                elapsed *= slow_factor
            best = min(best, elapsed)
        out[name] = factor * numel * 4 / best / 1e9
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def node_groups(node_of: list[int], device_type: str) -> dict[str, Any]:
    """DeviceMesh dims ``inter_node`` (rows: a local index on every node) x ``intra_node`` (a node's ranks).

    ``node_of[rank]`` is each rank's node. Needs the same number of ranks on every node (torchrun's
    ``--nproc-per-node``, Slurm's ``--ntasks-per-node``): nodes of different sizes get no node groups,
    one rank per node no intra-node one, one node no inter-node one. Collective: every rank calls it
    with the same ``node_of``. A DeviceMesh (torch's) rather than hand-made ``new_group`` calls: it
    creates the row and column groups the same way on every rank.
    """
    from torch.distributed.device_mesh import DeviceMesh

    nodes = sorted(set(node_of))
    members = [[r for r, n in enumerate(node_of) if n == node] for node in nodes]
    if len({len(m) for m in members}) != 1:
        return {}
    # rows are nodes, columns local indices: dim 0 (across the rows) joins the nodes, dim 1 is one node
    mesh = DeviceMesh(device_type, torch.tensor(members), mesh_dim_names=("inter_node", "intra_node"))
    wanted = {"inter_node": len(nodes) > 1, "intra_node": len(members[0]) > 1}
    return {name: mesh.get_group(name) for name, keep in wanted.items() if keep}


def measure(
    mesh: Any,
    device: torch.device,
    *,
    slow_factor: float = 1.0,
    slow_link: str | None = None,
    node: int = 0,
    node_links: dict[str, Any] | None = None,
    node_of: list[int] | None = None,
) -> dict[str, Any]:
    """This rank's burn-in and the bandwidth of each of its mesh groups and node groups.

    ``slow_factor`` slows the burn-in, or, with ``slow_link``, the bandwidth over that kind of group.
    """
    record: dict[str, Any] = {
        "rank": dist.get_rank(),
        "node": node,
        "host": socket.gethostname(),
        "tflops": burn_in(device, slow_factor=1.0 if slow_link else slow_factor),
        "links": {},
    }
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    groups = {name: mesh.get_group(i) for i, name in enumerate(names) if mesh.size(i) > 1}
    groups.update(node_links or {})
    for name, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        link: dict[str, Any] = {"ranks": ranks}
        if node_of is not None:
            link["nodes"] = sorted({node_of[r] for r in ranks})
        link.update(bandwidth(group, device, slow_factor=slow_factor if slow_link == name else 1.0))
        record["links"][name] = link
    return record


def best_of(first: list[dict[str, Any]], again: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's record with every figure at its best over two rounds (a fault is slow in both)."""
    out = []
    for a, b in zip(first, again):
        r = {**a, "tflops": max(a["tflops"], b["tflops"]), "links": {}}
        for dim, link in a["links"].items():
            other = b["links"].get(dim, link)
            r["links"][dim] = {k: (max(v, other[k]) if k.endswith("_gbps") else v) for k, v in link.items()}
        out.append(r)
    return out


def _where(r: dict[str, Any]) -> str:
    return f"node {r['node']}, {r['host']}" if "node" in r else str(r["host"])


def judge(records: list[dict[str, Any]], threshold: float) -> tuple[list[str], dict[str, Any]]:
    """Short phrases naming slow ranks and links, and the medians they were compared with."""
    found: list[str] = []
    median_tflops = statistics.median(r["tflops"] for r in records)
    for r in records:
        if r["tflops"] < threshold * median_tflops:
            found.append(
                f"rank {r['rank']} ({_where(r)}) matmul {r['tflops']:.4g} TFLOP/s vs median {median_tflops:.4g}"
            )
    medians: dict[str, Any] = {"tflops": median_tflops}
    for dim in sorted({d for r in records for d in r["links"]}):
        groups = {tuple(r["links"][dim]["ranks"]): r["links"][dim] for r in records if dim in r["links"]}
        nodes = {g: link.get("nodes") for g, link in groups.items()}
        for key in ("all_reduce_gbps", "all_gather_gbps"):
            # one figure per group: its slowest member's view (a collective waits for every member)
            per_group = {
                g: min(r["links"][dim][key] for r in records if tuple(r["links"].get(dim, {}).get("ranks", ())) == g)
                for g in groups
            }
            med = statistics.median(per_group.values())
            medians[f"{dim}.{key}"] = med
            for g, value in per_group.items():
                if len(per_group) > 1 and value < threshold * med:
                    on = (
                        f" (node{'s' if len(nodes[g]) > 1 else ''} {', '.join(map(str, nodes[g]))})" if nodes[g] else ""
                    )
                    found.append(
                        f"{dim} group {list(g)}{on} {key.removesuffix('_gbps')} {value:.3g} GB/s vs median {med:.3g}"
                    )
    return found, medians
