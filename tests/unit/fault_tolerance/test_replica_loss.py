"""Lose a replica group, keep training: HSDP dp_replicate 2 x dp_shard 2 on real gloo processes.

Both ranks of replica group 1 SIGKILL themselves at step 5 of 12, after their backward and before the
cross-replica sum; replica group 0 notices, agrees on the new membership through the store, rebuilds its
cross-replica group, trains group 1's samples of that step and of every later one, and goes on without a
restart. The launcher then starts group 1 again; it is admitted at a later step with the weights and
optimizer state of group 0 (no checkpoint). Group 0's losses, pre-clip gradient norms (clipping engaged,
lr 1e-2) and final weights equal one process trained on the same global batches; group 1's final weights
equal group 0's bitwise. Three mutants (a wrong recovery) run in the same launch, each as 2 replicas of one
rank. The ranks are processes forked by one launcher (tests/support/scripts/replica_loss.py), not the
reused worlds: two of them must die.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity import TOL32 as TOL  # its script trains in fp32
from paths import SCRIPTS, SUPPORT

pytestmark = pytest.mark.slow

# mutant -> whether its job restarts the killed group (the rejoin)
MUTANTS = {"ft_survivors_keep_old_normaliser": 0, "ft_dead_samples_skipped": 0, "ft_rejoin_stale_weights": 1}


def _errors(out: Path, ref: dict) -> dict[str, float]:
    """Worst relative error of each kind: losses, pre-clip norms, final weights (per parameter)."""
    got = json.loads((out / "curve-replica0.json").read_text())
    params = torch.load(out / "params-replica0.pt")
    loss = max(abs(g - r) / abs(r) for g, r in zip(got["losses"], ref["losses"], strict=True))
    norm = max(abs(g - r) / abs(r) for g, r in zip(got["norms"], ref["norms"], strict=True))
    weights = max(float((params[n] - p).abs().max() / p.abs().max()) for n, p in ref["params"].items())
    return {"loss": loss, "norm": norm, "params": weights}


def test_survivors_of_a_lost_replica_group_finish_equal_to_one_process(tmp_path):
    from scripts.replica_loss import CLIP, KILL_STEP, STEPS, reference

    jobs = ["hsdp2x2:2:2:1", *(f"{m}:2:1:{rejoin}:{m}" for m, rejoin in MUTANTS.items())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    launch = subprocess.Popen([sys.executable, str(SCRIPTS / "replica_loss.py"), str(tmp_path), *jobs], env=env)
    try:
        ref = reference(STEPS)  # one process, while the jobs run
        assert launch.wait(timeout=480) == 0
    finally:
        if launch.poll() is None:
            launch.kill()
    assert sum(n > CLIP for n in ref["norms"]) >= STEPS // 2, f"clipping idle: {ref['norms']}"
    codes = json.loads((tmp_path / "codes.json").read_text())
    out = tmp_path / "hsdp2x2"
    logs = {p.name: p.read_text() for p in out.glob("rank-*.log")}
    assert codes["hsdp2x2"] == [0, 0, -9, -9, 0, 0], (codes, logs)
    err = _errors(out, ref)
    assert err["loss"] <= TOL.loss and err["norm"] <= TOL.norm and err["params"] <= TOL.params, err
    assert json.loads((out / "curve-replica0.json").read_text())["members"] == [0, 1]
    rejoined = json.loads((out / "curve-replica1.json").read_text())["first_step"]
    assert KILL_STEP < rejoined < STEPS
    mine, peers = torch.load(out / "params-replica1.pt"), torch.load(out / "params-replica0.pt")
    assert all(torch.equal(mine[n], peers[n]) for n in peers)
    # One log line and one run_dir row per membership change, from one rank.
    lines = [line for text in logs.values() for line in text.splitlines() if line.startswith("lit-titan: replica")]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"lit-titan: replica group 1 (ranks 2 3) left at step {KILL_STEP};"), lines
    assert lines[1].startswith(f"lit-titan: replica group 1 (ranks 2 3) joined at step {rejoined} "), lines
    rows = list(csv.DictReader((out / "membership.csv").open()))
    got = [(r["step"], r["event"], r["replicas"], r["ranks"], r["members"]) for r in rows]
    assert got == [(str(KILL_STEP), "left", "1", "2 3", "0"), (str(rejoined), "joined", "1", "2 3", "0 1")]
    assert sum(float(rows[0][k]) for k in ("detect_s", "agree_s", "rebuild_s")) < 30, rows
    # Each planted bug moves the result by >= 10x the tolerance.
    for mutant, rejoin in MUTANTS.items():
        assert codes[mutant] == [0, -9] + [0] * rejoin, (mutant, codes)
        err = _errors(tmp_path / mutant, ref)
        assert max(err[k] / getattr(TOL, k) for k in err) >= 10, (mutant, err)
