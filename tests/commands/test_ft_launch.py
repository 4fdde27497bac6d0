"""One torchrun agent per replica group: a dead group's agent restarts it alone and it rejoins.

The production launch of docs/fault_tolerance.md ("Launching one torchrun per replica group"), on this
machine: ``lit-titan store`` hosts the job's store; two torchrun agents (``--standalone
--nproc-per-node=2 --max-restarts=1``), one per replica group of dp_replicate 2 x dp_shard 2, each with
``fault_tolerance.replica_id`` and ``fault_tolerance.store``; the parity regime (fp32, lr 1e-2, clipping
engaged, 8 steps). Rank 1 of group 1 SIGKILLs itself after step 1 (``fault.at_step=2``): group 1's agent
stops its other rank and starts both again; group 0 trains group 1's samples meanwhile and holds at step 3
(``fault.pause``, released by this test once the restarted ranks wait to be admitted, however loaded the
machine), then admits them at step 5. Group 0's agent never restarts (its ranks started once), both agents
end 0, group 0 matches the one-process reference (``parity_reference``) and the rejoined group's last
step equals group 0's bitwise. Real agents, so fresh interpreters per rank: 6 rank starts, the fewest
that show a group restarted by its own agent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lit_titan.cli.launch import launch_command
from lit_titan.config import compose
from parity import PARITY, check_case
from paths import SCRIPTS, SUPPORT

pytestmark = pytest.mark.slow

KILL_STEP = 2
REJOIN_STEP = KILL_STEP + 1 + 2  # held at KILL_STEP + 1, admitted ADMIT_AFTER_STEPS later
LIMIT_S = 400  # a loaded 2-core machine: 6 interpreters importing torch and Lightning
FT = [
    "cluster.devices=2",  # one replica group's processes, its torchrun's --nproc-per-node
    "cluster.num_nodes=2",  # the job: every group's "node"
    "parallel.dp_replicate=2",
    "checkpoint.enabled=false",
    "fault_tolerance.enabled=true",
    "fault_tolerance.dead_after_s=1",
    "cluster.timeout_s=300",  # group 0's rank 1 waits at step 3 while rank 0 holds for the rejoin
]
_DROP = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def _env(tmp_path: Path) -> dict[str, str]:
    """This interpreter as ``python`` and ``torchrun`` on PATH (the printed lines name them), tests/support importable."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"python": '"$@"', "torchrun": '-m torch.distributed.run "$@"'}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nexec {sys.executable} {body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(("LIT_TITAN_", "PL_"))}
    path = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    return {**env, "PATH": path, "PYTHONPATH": os.pathsep.join([str(SUPPORT), env.get("PYTHONPATH", "")])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _printed(run: Path) -> tuple[str, str]:
    """The store line and the per-group torchrun line that ``lit-titan launch --dry-run`` prints."""
    overrides = [*PARITY, *FT, f"run_dir={run}"]
    lines = [line for line in launch_command(compose(overrides), overrides).splitlines() if not line.startswith("#")]
    store, agent = lines
    assert "--max-restarts=3" in agent and "--nnodes=1 --nproc_per_node=2" in agent and "resume=" not in agent
    return store, agent


def test_one_torchrun_per_replica_group_restarts_only_the_dead_group(parity_reference, tmp_path):
    run = tmp_path / "ft"
    run.mkdir()
    store_line, agent_line = _printed(run)
    port = _free_port()
    store = f"127.0.0.1:{port}"
    env = _env(tmp_path)
    store_proc = subprocess.Popen(
        ["bash", "-c", store_line.replace("--port 29600", f"--port {port} --host 127.0.0.1")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    # The printed line with this test's stand-in for the train module (the parity dump, a record per start),
    # one restart (enough for the drill) and the drill: group 1's rank 1 dies after step 1, group 0's rank 0
    # holds at step 3 until this test lets it go.
    agent_line = agent_line.replace("--max-restarts=3", "--max-restarts=1")
    agent_line = agent_line.replace("-m lit_titan.train", f"{SCRIPTS / 'ft_group.py'} {run}")
    drills = [
        f" fault.kill_rank=0 fault.at_step={KILL_STEP + 1} fault.pause=true",
        f" fault.kill_rank=1 fault.at_step={KILL_STEP}",
    ]
    agents: list[subprocess.Popen] = []
    try:
        line = store_proc.stdout.readline()
        assert f"store listening on {store};" in line, line
        for replica, drill in enumerate(drills):
            log = (run / f"agent-{replica}.log").open("w")
            agents.append(
                subprocess.Popen(
                    ["bash", "-c", agent_line + drill],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, "REPLICA": str(replica), "LIT_TITAN_STORE": store},
                    cwd=tmp_path,
                    start_new_session=True,
                )
            )
        # Hold group 0 at step 3 until the restarted group 1 waits to be admitted (ft_trainer.py does the same).
        client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        deadline, paused = time.monotonic() + LIMIT_S, None
        while time.monotonic() < deadline:
            assert all(a.poll() is None for a in agents), [(run / f"agent-{r}.log").read_text()[-4000:] for r in (0, 1)]
            paused = re.search(r"rank 0 \(pid (\d+)\) paused", (run / "agent-0.log").read_text())
            if paused and client.add("lit_titan/ft/join/1", 0) >= 2:
                break
            time.sleep(0.2)
        assert paused, [(run / f"agent-{r}.log").read_text()[-4000:] for r in (0, 1)]
        os.kill(int(paused.group(1)), signal.SIGCONT)
        codes = [a.wait(timeout=max(deadline - time.monotonic(), 1)) for a in agents]
    finally:
        for proc in (*agents, store_proc):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL if proc is not store_proc else signal.SIGTERM)
        store_proc.wait(timeout=30)
    logs = [(run / f"agent-{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], [log[-5000:] for log in logs]
    assert store_proc.returncode == 0

    # Group 0's ranks started once, under restart count 0; group 1's twice, the second time by its own agent.
    def starts(dump: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((run / dump).glob("start-rank-*.json"))]

    first, again = starts("dump-replica1"), starts("dump-replica1-restart1")
    assert [s["TORCHELASTIC_RESTART_COUNT"] for s in starts("dump")] == ["0", "0"]
    assert not list(run.glob("dump-restart*")), "group 0's agent restarted its workers"
    assert [s["RANK"] for s in again] == ["0", "1"] and {s["WORLD_SIZE"] for s in again} == {"2"}
    assert len({s["agent_pid"] for s in first + again}) == 1  # the same agent started group 1 both times
    assert logs[1].count("fault injection: killing rank 1") == 1 and "killing" not in logs[0]
    lines = re.findall(r"lit-titan: replica group .*", logs[0])
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"lit-titan: replica group 1 (ranks 2 3) left at step {KILL_STEP};"), lines
    assert lines[1].startswith(f"lit-titan: replica group 1 (ranks 2 3) joined at step {REJOIN_STEP} "), lines
    # The job: equal to one process; the rejoined group's last step equals group 0's bitwise.
    check_case("ft_launch_per_group", parity_reference, run)
    mine, peers = (
        torch.load(run / d / "step-000007.pt", weights_only=True) for d in ("dump-replica1-restart1", "dump")
    )
    assert mine["norm"] == peers["norm"]
    assert all(torch.equal(mine[k][n], peers[k][n]) for k in ("grads", "params") for n in peers[k])
