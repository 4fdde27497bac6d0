"""Train like ``python -m lit_titan.train`` and record where each rank sits, for the multi-node tests.

Usage (under torchrun, one agent per "node"): node_topology.py [hydra overrides]

Each rank writes ``<run_dir>/topology/attempt-<A>-rank-<R>.json`` once its mesh exists: the
launcher's view (global rank, local rank, the agent's node rank ``GROUP_RANK``, hostname, the
agent's pid, ``TEST_NODE`` that the test sets per agent) and the mesh's view (its coordinate on
every dim and the global ranks of its ``dp_replicate`` and ``dp_shard`` groups, read from the live
process groups). The test then checks that the replicate dim runs across nodes and the shard dim
inside one.
"""

import json
import os
import socket
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from lit_titan.config import compose
from lit_titan.job.run import train


class RecordTopology(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        mesh = strategy.device_mesh
        record = {
            "rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "group_rank": int(os.environ["GROUP_RANK"]),
            "hostname": socket.gethostname(),
            "agent_pid": os.getppid(),
            "test_node": os.environ.get("TEST_NODE"),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "attempt": getattr(strategy, "restart_attempt", None),
            "coords": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())),
            "groups": {
                dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("dp_replicate", "dp_shard")
            },
        }
        out = Path(trainer.default_root_dir) / "topology"
        out.mkdir(parents=True, exist_ok=True)
        attempt = record["attempt"] if record["attempt"] is not None else record["restart_count"]
        (out / f"attempt-{attempt}-rank-{record['rank']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    # It stands in for ``python -m lit_titan.train`` on the torchrun line, so it ends its ranks the same
    # way (lit_titan/job/ranks.py exit_rank): a plain interpreter exit can abort in gloo's teardown,
    # and torchrun then restarts a finished job.
    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import user_errors

    run_entry_point(lambda: train(compose(sys.argv[1:]), callbacks=[RecordTopology()]), user_errors, rank_failures=True)
