"""A world case: pre-flight only, with the 4 ranks of a world seen as 2 nodes x 2 ranks (node-major).

The launcher's view is set as torchrun/Lightning set it for a 2-node job (LOCAL_RANK, NODE_RANK,
LOCAL_WORLD_SIZE; the world restores its own environment after the case), so Lightning's
``trainer.node_rank`` is the node and the global ranks stay node * 2 + local. Returns the one-line
verdict (``preflight.action=stop``) and preflight.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RANKS_PER_NODE = 2


def main(argv: list[str]) -> dict[str, Any]:
    from lit_titan.observe.diagnostics import PreflightError, PreflightFinished
    from lit_titan.train import main as train_main

    rank = int(os.environ["RANK"])
    os.environ.update(
        LOCAL_RANK=str(rank % RANKS_PER_NODE),
        NODE_RANK=str(rank // RANKS_PER_NODE),
        LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
    )
    run_dir = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")))
    stopped = None
    try:
        train_main(
            [
                *argv,
                "cluster.devices=2",
                "cluster.num_nodes=2",
                "preflight.enabled=true",
                "preflight.only=true",
                "preflight.action=stop",
                "checkpoint.enabled=false",
            ]
        )
    except PreflightError as err:
        stopped = str(err)
    except PreflightFinished:
        pass
    if rank != 0:  # rank 0 writes preflight.json; the world returns rank 0's answer
        return {}
    return {"stopped": stopped, "report": json.loads((run_dir / "preflight.json").read_text())}
