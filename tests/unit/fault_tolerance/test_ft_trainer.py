"""``fault_tolerance.enabled=true`` through the real trainer: lose a replica group, finish equal to one process,
and rejoin; with FSDP, and with pipeline stages, inside each group.

4 processes, each replica group its own world (a "node" of 2 ranks): dp_replicate 2 x dp_shard 2, or dp_replicate
2 x pp 2 (1F1B; each stage rank sums its stage's gradients with the same stage of the other group). Both with
gradient accumulation: dp_shard 2 at micro-batch 1 (2 micro-batches per rank before the fault, 4 after), pp 2 at
micro-batch 2 (2 schedule steps of 2 pipeline micro-batches per group before the fault, 4 after). The parity regime
(fp32, lr 1e-2, clipping engaged). Both ranks of replica group 1 SIGKILL themselves after step 1
(``fault.kill_rank`` per group rank, ``fault.at_step=2``); group 0 notices in step 2's cross-replica sum, trains
group 1's samples and goes on without a restart. The launcher starts group 1 again (group 0's first rank holds at
step 3 until the restarted ranks wait to be admitted, however loaded the machine); they are admitted at step 5
with group 0's weights and optimizer state, their data loader, step counter and LR schedule at that step. Group
0's losses, pre-clip gradients, clip norm and weights (dumped at steps 0, 4 and 7) equal the one-process
reference's (``parity_reference``); the rejoined group's step-7 dump equals group 0's bitwise; the throughput
callback divides by the job's 4 ranks. The pp case also runs its mutant (one fault-free step). The ranks are
forked by tests/support/scripts/ft_trainer.py, which hosts the store: two of them must die, so not the reused
worlds. The run's report shows the fault and the rejoin on its timeline.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from parity import MASKED_DROP, MIN_LOSS_DROP, PARITY, TOL, check_case, compare
from paths import SCRIPTS, SUPPORT

pytestmark = pytest.mark.slow

KILL_STEP = 2
REJOIN_STEP = KILL_STEP + 1 + 2  # held at KILL_STEP + 1, admitted ADMIT_AFTER_STEPS later
FT = [
    "cluster.devices=2",  # one replica group's processes (each group is a "node", as its own launch)
    "cluster.num_nodes=2",
    "parallel.dp_replicate=2",
    "checkpoint.enabled=false",
    "fault_tolerance.enabled=true",
    "fault_tolerance.dead_after_s=1",
    "cluster.timeout_s=60",
]


# case -> (layout, the mutant its run must catch, a user's subclass trained instead of PretrainModule). The HSDP
# case trains tests/support/user_modules.py's MaskedLabels: unequal valid targets per replica group, before and
# after the fault, against one process of the same subclass (the step runner's global normaliser).
LAYOUTS = {
    "ft_hsdp2x2_accum_masked": (["data.micro_batch_size=1"], None, "MaskedLabels"),
    "ft_pp2_accum": (["parallel.pp=2", "data.micro_batch_size=2"], "ft_pp_sum_skips_a_stage", None),
}


def _launch(
    run, kill_step: int, restart: bool, overrides: list[str], mutant: str | None = None, module: str | None = None
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(SCRIPTS / "ft_trainer.py"), str(run), str(kill_step), "1" if restart else "0"]
    cmd += ["--module", module] if module else []
    subprocess.run([*cmd, *(["--mutant", mutant] if mutant else []), *overrides], env=env, timeout=400, check=True)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_trainer_survives_a_lost_replica_group_equal_to_one_process(parity_reference, masked_reference, tmp_path, case):
    run = tmp_path / "ft"
    layout, mutant, module = LAYOUTS[case]
    _launch(run, KILL_STEP, True, [*PARITY, *FT, *layout], mutant, module)
    reference = masked_reference if module else parity_reference
    codes = json.loads((run / "codes.json").read_text())
    logs = {p.name: p.read_text() for p in run.glob("rank-*.log")}
    assert codes == [0, 0, -9, -9, 0, 0], (codes, {k: v[-3000:] for k, v in logs.items()})
    check_case(case, reference, run, min_loss_drop=MASKED_DROP if module else MIN_LOSS_DROP)
    last = json.loads((run / "throughput.json").read_text())  # its last step: 4 live ranks, 8 x 32 tokens
    assert last["global_tokens"] == 256 and last["tokens_per_sec_per_device"] * 4 == pytest.approx(
        256 / last["step_seconds"]
    )
    mine, peers = (torch.load(run / d / "step-000007.pt", weights_only=True) for d in ("dump-rejoined", "dump"))
    assert mine["norm"] == peers["norm"]
    assert all(torch.equal(mine[k][n], peers[k][n]) for k in ("grads", "params") for n in peers[k])
    lines = [line for text in logs.values() for line in text.splitlines() if line.startswith("lit-titan: replica")]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"lit-titan: replica group 1 (ranks 2 3) left at step {KILL_STEP};"), lines
    assert lines[1].startswith(f"lit-titan: replica group 1 (ranks 2 3) joined at step {REJOIN_STEP} "), lines
    rows = list(csv.DictReader((run / "membership.csv").open()))
    got = [(r["step"], r["event"], r["replicas"], r["members"]) for r in rows]
    assert got == [(str(KILL_STEP), "left", "1", "0"), (str(REJOIN_STEP), "joined", "1", "0 1")], got
    # The report shows the fault and the rejoin on the timeline (lit_titan/report/)
    from lit_titan.report.figures import build_figures
    from lit_titan.report.runs import load_run

    faults = {f.id: f for f in build_figures([load_run(run)])}["faults"].series["replica groups"]
    assert faults["x"][:4] == [KILL_STEP, KILL_STEP, REJOIN_STEP, REJOIN_STEP] and faults["y"][:4] == [2, 1, 1, 2]
    if mutant:  # the planted bug, one fault-free step after the run: the step-0 gradients already miss the reference
        ratio, what = compare(parity_reference / "dump", run / "mutant" / "dump", steps=[0]).margin(TOL)
        assert ratio >= 10, (mutant, what)
