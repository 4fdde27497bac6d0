"""Multi-node for real, on one machine.

Two torchrun agents act as two nodes (``--nnodes=2``, c10d rendezvous on 127.0.0.1, two processes
each) and train HSDP with ``dp_replicate=2`` across the nodes and ``dp_shard=2`` inside each, to
the losses of one process; the replicate dim is checked to run across the nodes from what every
rank records (``tests/support/scripts/node_topology.py``). Killing a rank of node 1 restarts both agents,
which resume from the newest checkpoint. The command ``lit-titan launch`` prints is what runs:
the torchrun line (under ``bash -c``, as on each node) and the sbatch script (under a stand-in
``sbatch``/``srun`` that starts the tasks here with Slurm's variables, ``tests/support/scripts/fake_slurm.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, assert_losses_match, losses, read_metrics
from lit_titan.cli.launch import check_cluster, launch_command
from lit_titan.config import ConfigError, compose
from paths import SCRIPTS

STEPS, EVERY, KILL_AT = 8, 3, 5
COMMON = [
    *TINY,
    f"trainer.max_steps={STEPS}",
    "seed=0",
    "precision=32-true",
    "trainer.deterministic=true",
    "checkpoint.keep_last=0",
]
# 2 "nodes" x 2 processes: replicate across the nodes, shard inside each.
HSDP = ["cluster.num_nodes=2", "cluster.devices=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
NODE_TIMEOUT_S = 900  # per job; a loaded 2-core machine (CI + other jobs) took 250-460 s for one
# Set in this process by in-process fits or our entry points; a node must not inherit them.
_DROP = (
    "LIT_TITAN_RUN_DIR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "GLOBAL_RANK",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in _DROP}, **extra}


def _run_nodes(cmds: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Start every node's command at once (each in its own session), wait for all; kill all on a timeout."""
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, start_new_session=True
        )
        for cmd, env in zip(cmds, envs)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=NODE_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired as err:
        for p in procs:
            _kill_group(p.pid)
        raise AssertionError(
            "nodes timed out:\n" + "\n".join((p.communicate()[0] or "")[-4000:] for p in procs)
        ) from err
    finally:
        for p in procs:
            _kill_group(p.pid)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs)]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def _printed(overrides: list[str], cwd: Path) -> str:
    """What ``lit-titan launch --dry-run OVERRIDES`` prints, through the real command line."""
    proc = subprocess.run(
        [sys.executable, "-m", "lit_titan.cli", "launch", "--dry-run", *overrides],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_clean_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def _bin_dir(tmp_path: Path) -> Path:
    """``srun`` (the stand-in), ``python`` (this interpreter, as the job's environment would put first)
    and, where this environment lacks it, ``torchrun``, on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shims = {
        "srun": f'exec {sys.executable} {SCRIPTS / "fake_slurm.py"} srun "$@"',
        "python": f'exec {sys.executable} "$@"',
    }
    if shutil.which("torchrun") is None:  # torch installed outside this venv's bin/
        shims["torchrun"] = f'exec {sys.executable} -m torch.distributed.run "$@"'
    for name, body in shims.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _topology(run_dir: Path, attempt: int) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "topology").glob(f"attempt-{attempt}-rank-*.json"))]
    return sorted(records, key=lambda r: r["rank"])


# ---- runs shared by the tests -----------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process(tmp_path_factory, worlds) -> Path:
    run_dir = tmp_path_factory.mktemp("one-process")
    worlds.train([*COMMON, "cluster.devices=1", "checkpoint.enabled=false"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """Two torchrun agents (``--node-rank=0/1``) on this machine, 2 processes each, HSDP 2 x 2."""
    run_dir = tmp_path_factory.mktemp("two-nodes")
    port = _free_port()
    cmds = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two-nodes",
            str(SCRIPTS / "node_topology.py"),
            *COMMON,
            *HSDP,
            f"checkpoint.every_n_steps={EVERY}",
            f"run_dir={run_dir}",
        ]
        for node in (0, 1)
    ]
    nodes = _run_nodes(cmds, [_clean_env(TEST_NODE=str(node)) for node in (0, 1)], cwd=run_dir)
    for node in nodes:
        assert node.returncode == 0, node.stdout[-6000:]
    return run_dir, nodes


# ---- two torchrun agents as two nodes ---------------------------------------------------------
@pytest.mark.slow
def test_two_nodes_train_hsdp_like_one_process(two_nodes, one_process):
    run_dir, _ = two_nodes
    assert [int(r["step"]) for r in read_metrics(run_dir)] == list(range(STEPS))
    assert_losses_match(losses(run_dir), losses(one_process), rtol=1e-5)
    # AdamW hides a uniform gradient scale from the losses; the logged global norm does not.
    norms = [float(r["train/grad_norm"]) for r in read_metrics(run_dir)]
    ref_norms = [float(r["train/grad_norm"]) for r in read_metrics(one_process)]
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-3, (norms, ref_norms)


@pytest.mark.slow
def test_replicate_dim_runs_across_nodes_and_shard_dim_inside_one(two_nodes):
    """Ranks are node-major, so dp_replicate (the outer data-parallel dim) spans the nodes and each
    FSDP shard group sits on one node: read from the live process groups of every rank."""
    run_dir, _ = two_nodes
    records = _topology(run_dir, attempt=0)
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    node_of = {r["rank"]: r["agent_pid"] for r in records}  # one agent per "node" (one hostname here)
    assert len(set(node_of.values())) == 2 and {r["test_node"] for r in records} == {"0", "1"}
    for r in records:
        assert r["rank"] == r["group_rank"] * 2 + r["local_rank"] and r["node_rank"] == r["group_rank"]
        assert r["coords"]["dp_replicate"] == r["group_rank"] and r["coords"]["dp_shard"] == r["local_rank"]
        assert len({node_of[q] for q in r["groups"]["dp_shard"]}) == 1, r  # shard group: inside one node
        assert len({node_of[q] for q in r["groups"]["dp_replicate"]}) == 2, r  # replicate group: across nodes
        assert r["rank"] in r["groups"]["dp_shard"] and r["rank"] in r["groups"]["dp_replicate"]


@pytest.mark.slow
def test_killed_rank_restarts_both_nodes_and_resumes(two_nodes, one_process, tmp_path):
    """The printed multi-node torchrun line, run on both "nodes" (bash -c, MASTER_ADDR=127.0.0.1).

    Rank 3 (node 1) is killed after step 5; node 1's agent restarts its workers, node 0's agent
    restarts its own because node 1 re-joined the rendezvous, and every rank agrees that this is
    attempt 1 (node 0's TORCHELASTIC_RESTART_COUNT stays 0 in that case: strategies/elastic.py).
    Both resume from step 3 and continue bitwise like the uninterrupted run.
    """
    ref_dir, _ = two_nodes
    run_dir = tmp_path / "run"
    line = _printed(
        [
            *COMMON,
            *HSDP,
            f"checkpoint.every_n_steps={EVERY}",
            "fault.kill_rank=3",
            f"fault.at_step={KILL_AT}",
            f"run_dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert "--rdzv_endpoint=${MASTER_ADDR" in line and "resume=auto" in line and "--max-restarts=3" in line
    line = line.replace("-m lit_titan.train", str(SCRIPTS / "node_topology.py"))  # records each attempt's layout
    path = f"{_bin_dir(tmp_path)}:{os.environ['PATH']}"
    port = str(_free_port())
    nodes = _run_nodes(
        [["bash", "-c", line]] * 2,
        [_clean_env(PATH=path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TEST_NODE=str(n)) for n in (0, 1)],
        cwd=tmp_path,
    )
    out = "\n".join(n.stdout for n in nodes)
    assert all(n.returncode == 0 for n in nodes), out[-8000:]
    assert out.count("fault injection: killing rank 3") == 1
    assert f"resuming from {run_dir / 'checkpoints' / 'step-000003'}" in out
    # One restart, and no rank of it read a dead attempt's rendezvous keys (what per-agent restart
    # counts led to: node 0's ranks failed in connectFullMesh and the job needed another attempt).
    assert out.count("resume=auto: resuming from") == 1 and "connectFullMesh" not in out, out[-8000:]
    again = _topology(run_dir, attempt=1)
    assert [r["rank"] for r in again] == [0, 1, 2, 3] and {r["attempt"] for r in again} == {1}
    assert [int(r["step"]) for r in read_metrics(run_dir)] == list(range(EVERY, STEPS))
    assert losses(run_dir) == losses(ref_dir)[EVERY:]  # the same layout resumes bitwise
    assert_losses_match(losses(run_dir), losses(one_process)[EVERY:], rtol=1e-5)
    assert (run_dir / "metrics.attempt-0.csv").is_file()


# ---- the printed sbatch script, under a stand-in Slurm ----------------------------------------
def _slurm_job_id() -> int:
    """A job id whose Lightning default port (15000 + last four digits) is free here."""
    for job_id in range(4000 + os.getpid() % 5000, 10000):
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 15000 + job_id % 10000))
            return job_id
        except OSError:
            continue
    raise RuntimeError("no free port in 19000-24999")


@pytest.mark.slow
def test_printed_sbatch_script_runs_under_stand_in_srun(one_process, tmp_path):
    """Two "nodes" x 2 tasks under the printed script's restart loop: rank 3 dies after step 5, srun
    ends the step, the loop starts attempt 1, which resumes from step 3 of the same run_dir (pinned
    to the job id by the script) and ends with the one-process losses."""
    script = _printed(
        [
            *COMMON,
            *HSDP,
            "cluster.launcher=srun",
            f"checkpoint.every_n_steps={EVERY}",
            "fault.kill_rank=3",
            f"fault.at_step={KILL_AT}",
        ],
        cwd=tmp_path,
    )
    assert "--gpus-per-node" not in script  # a CPU job asks for no GPUs
    (tmp_path / "job.sh").write_text(script + "\n")
    job_id = _slurm_job_id()
    env = _clean_env(PATH=f"{_bin_dir(tmp_path)}:{os.environ['PATH']}", FAKE_SLURM_JOB_ID=str(job_id))
    [job] = _run_nodes([[sys.executable, str(SCRIPTS / "fake_slurm.py"), "sbatch", "job.sh"]], [env], cwd=tmp_path)
    assert job.returncode == 0, job.stdout[-8000:]
    run_dir = tmp_path / "runs" / f"llama3_debug-{job_id}"
    assert "fault injection: killing rank 3" in job.stdout
    assert f"resuming from {run_dir / 'checkpoints' / 'step-000003'}" in job.stdout
    assert [int(r["step"]) for r in read_metrics(run_dir)] == list(range(EVERY, STEPS))
    assert_losses_match(losses(run_dir), losses(one_process)[EVERY:], rtol=1e-5)


def test_stand_in_sbatch_refuses_gpus_on_a_cpu_job(tmp_path):
    """Why the CPU script must not carry --gpus-per-node: the stand-in refuses it, as Slurm does."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "job.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --gpus-per-node=2\necho ran\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fake_slurm.py"), "sbatch", "job.sh"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "ran" not in proc.stdout and "Requested node configuration" in proc.stderr


# ---- what is printed, and bad input (no processes) --------------------------------------------
def test_printed_commands_find_node_zero_and_agree_on_run_dir():
    multi = launch_command(compose([*HSDP]), [*HSDP])
    assert "--rdzv_endpoint=${MASTER_ADDR:?" in multi and "--nnodes=2 --nproc_per_node=2" in multi
    assert "run_dir=runs/llama3_debug-" in multi and "resume=auto" in multi  # pinned once, for every node
    gpu = launch_command(compose(["cluster=h100_64"]), ["cluster=h100_64"])
    assert "#SBATCH --gpus-per-node=8" in gpu and '"run_dir=runs/llama3_debug-$SLURM_JOB_ID"' in gpu
    cpu = launch_command(compose([*HSDP, "cluster.launcher=srun"]), [*HSDP, "cluster.launcher=srun"])
    assert "#SBATCH --nodes=2" in cpu and "#SBATCH --ntasks-per-node=2" in cpu and "--gpus-per-node" not in cpu
    own = launch_command(compose(["cluster=h100_64", "run_dir=/shared/a"]), ["cluster=h100_64", "run_dir=/shared/a"])
    assert "$SLURM_JOB_ID" not in own and "run_dir=/shared/a" in own


@pytest.mark.parametrize(
    "overrides,names",
    [
        (
            ["cluster.num_nodes=2", "cluster.devices=2", "parallel.dp_replicate=2", "parallel.dp_shard=4"],
            "cluster.num_nodes",
        ),
        (["cluster=h100_64", "cluster.devices=16"], "cluster.gpus_per_node=8"),
        (["cluster.launcher=mpirun"], "cluster.launcher=mpirun: not an option; choose one of torchrun, srun"),  # schema
    ],
    ids=["nodes-x-devices-vs-layout", "devices-above-gpus-per-node", "unknown-launcher"],
)
def test_a_profile_that_does_not_fit_the_layout_is_one_line(overrides, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        check_cluster(compose(overrides))


def test_launch_refuses_before_starting_anything(tmp_path):
    """Through the command line, without --dry-run: one line, exit 2, nothing started or written."""
    proc = subprocess.run(
        [sys.executable, "-m", "lit_titan.cli", "launch", *HSDP[:3], "parallel.dp_shard=4"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_clean_env(MASTER_ADDR="127.0.0.1"),
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lit-titan: error: cluster has 2 node(s) x 2 device(s)")
    assert "cluster.num_nodes" in lines[0] and not list(tmp_path.iterdir())
    no_addr = subprocess.run(
        [sys.executable, "-m", "lit_titan.cli", "launch", *HSDP],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_clean_env(),
        timeout=300,
    )
    assert no_addr.returncode == 2 and "set MASTER_ADDR" in no_addr.stderr and not list(tmp_path.iterdir())
