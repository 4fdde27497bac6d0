"""``fault_tolerance.enabled=true`` through the real trainer: lose a replica group, finish equal to one process.

4 processes as dp_replicate 2 x dp_shard 2 (each replica group its own world, "node" of 2 ranks), gradient
accumulation (micro-batch 1: 2 micro-batches per rank before the fault, 4 after), the parity regime (fp32,
lr 1e-2, clipping engaged). Both ranks of replica group 1 SIGKILL themselves after step 4 (``fault.kill_rank``
per group rank, ``fault.at_step=5``); group 0 notices in step 5's cross-replica sum, trains group 1's samples
and finishes without a restart. Its losses, pre-clip gradients, clip norm and weights (dumped at steps 0, 4
and 7) equal the one-process reference's (``parity_reference``). The ranks are forked by
tests/support/scripts/ft_trainer.py, which hosts the store: two of them must die, so not the reused worlds.
The launcher then starts group 1 again: refused in one line (rejoining a running trainer is not done yet).
The run's report shows the fault on its timeline.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from parity import PARITY, check_case
from paths import SCRIPTS, SUPPORT

pytestmark = pytest.mark.slow

KILL_STEP = 5
FT = [
    "cluster.devices=2",  # one replica group's processes (each group is a "node", as its own launch)
    "cluster.num_nodes=2",
    "parallel.dp_replicate=2",
    "data.micro_batch_size=1",
    "checkpoint.enabled=false",
    "fault_tolerance.enabled=true",
    "fault_tolerance.dead_after_s=1",
    "cluster.timeout_s=60",
]


def test_trainer_survives_a_lost_replica_group_equal_to_one_process(parity_reference, tmp_path):
    run = tmp_path / "ft"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(SCRIPTS / "ft_trainer.py"), str(run), str(KILL_STEP), "1", *PARITY, *FT]
    subprocess.run(cmd, env=env, timeout=400, check=True)
    codes = json.loads((run / "codes.json").read_text())
    logs = {p.name: p.read_text() for p in run.glob("rank-*.log")}
    assert codes == [0, 0, -9, -9, 1, 1], (codes, {k: v[-3000:] for k, v in logs.items()})
    # The launcher starts group 1 again: refused in one line (a running trainer cannot rejoin it yet).
    for rank in (2, 3):
        assert "replica group 1 started again while the others train" in logs[f"rank-{rank}-restarted.log"]
    check_case("ft_hsdp2x2_accum", parity_reference, run)
    lines = [line for text in logs.values() for line in text.splitlines() if line.startswith("lit-titan: replica")]
    assert len(lines) == 1 and lines[0].startswith(f"lit-titan: replica group 1 (ranks 2 3) left at step {KILL_STEP};")
    rows = list(csv.DictReader((run / "membership.csv").open()))
    assert [(r["step"], r["event"], r["replicas"], r["members"]) for r in rows] == [(str(KILL_STEP), "left", "1", "0")]
    # The report shows the fault on the timeline (lit_titan/report/)
    from lit_titan.report.figures import build_figures
    from lit_titan.report.runs import load_run

    faults = {f.id: f for f in build_figures([load_run(run)])}["faults"].series["replica groups"]
    assert faults["x"][:2] == [KILL_STEP, KILL_STEP] and faults["y"][:2] == [2, 1], faults
