"""A stand-in for Slurm's ``sbatch`` and ``srun`` on one machine, for running printed job scripts in tests.

    fake_slurm.py sbatch SCRIPT      # run SCRIPT as the batch step of a job (its #SBATCH lines)
    fake_slurm.py srun [OPTIONS] CMD  # inside SCRIPT (a ``srun`` on PATH execs this): start the tasks

No Slurm is installed here, so this does what Slurm does for a job, with every "node" on this
machine: ``sbatch`` reads ``--nodes``, ``--ntasks-per-node``, ``--job-name`` and refuses
``--gpus-per-node`` when there is no GPU (as a CPU partition does), then runs the script with the
allocation's variables (``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``,
...). ``srun`` starts ``--ntasks-per-node`` tasks on each node with the per-task variables
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURMD_NODENAME``), node-major like
Slurm's block distribution, waits for all of them, and with ``--kill-on-bad-exit=1`` kills the
others as soon as one fails, exiting with that task's code.

The node names are ``FAKE_SLURM_NODES`` (default ``127.0.0.1,localhost``: two names for this host,
so Lightning resolves the first as the job's main address), and the job id ``FAKE_SLURM_JOB_ID``
(Lightning derives its default port from it: 15000 + its last four digits).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time


def _sbatch(script: str) -> int:
    text = open(script).read()
    opts = dict(re.findall(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", text, flags=re.M))
    if "gpus-per-node" in opts:
        import torch

        if not torch.cuda.is_available():
            print(
                "sbatch: error: Batch job submission failed: Requested node configuration is not available "
                "(--gpus-per-node on nodes without GPUs)",
                file=sys.stderr,
            )
            return 1
    nodes = os.environ.get("FAKE_SLURM_NODES", "127.0.0.1,localhost").split(",")
    nnodes, per_node = int(opts.get("nodes", 1)), int(opts.get("ntasks-per-node", 1))
    if nnodes > len(nodes):
        print(f"sbatch: error: --nodes={nnodes} but this fake cluster has {len(nodes)}", file=sys.stderr)
        return 1
    nodelist = ",".join(nodes[:nnodes])
    job_id = os.environ.get("FAKE_SLURM_JOB_ID", str(os.getpid()))
    env = dict(
        os.environ,
        SLURM_JOB_ID=job_id,
        SLURM_JOBID=job_id,
        SLURM_JOB_NAME=opts.get("job-name", "job"),
        SLURM_NNODES=str(nnodes),
        SLURM_JOB_NUM_NODES=str(nnodes),
        SLURM_NTASKS=str(nnodes * per_node),
        SLURM_NPROCS=str(nnodes * per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_TASKS_PER_NODE=f"{per_node}(x{nnodes})",
        SLURM_JOB_NODELIST=nodelist,
        SLURM_NODELIST=nodelist,
        SLURM_SUBMIT_DIR=os.getcwd(),
        SLURMD_NODENAME=nodes[0],
        SLURM_NODEID="0",
    )
    return subprocess.run(["bash", script], env=env).returncode


def _die_with_parent() -> None:
    """A task outside our session would outlive a killed srun (a test's timeout): tie it to srun's life."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _srun(argv: list[str]) -> int:
    kill_on_bad_exit = False
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt.startswith("--kill-on-bad-exit"):
            kill_on_bad_exit = opt.split("=", 1)[1] != "0" if "=" in opt else True
    nodes = os.environ["SLURM_JOB_NODELIST"].split(",")
    per_node, nnodes = int(os.environ["SLURM_NTASKS_PER_NODE"]), int(os.environ["SLURM_NNODES"])
    step = os.environ.get("FAKE_SLURM_STEP", "0")
    tasks = []
    for node in range(nnodes):
        for local in range(per_node):
            env = dict(
                os.environ,
                SLURM_PROCID=str(node * per_node + local),
                SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node),
                SLURMD_NODENAME=nodes[node],
                SLURM_STEP_ID=step,
                SLURM_STEP_NUM_TASKS=str(nnodes * per_node),
                SLURM_STEP_NUM_NODES=str(nnodes),
                SLURM_STEP_NODELIST=",".join(nodes[:nnodes]),
            )
            # Each task in its own session, as torchrun starts its workers (and as separate nodes would be):
            # with the kernel's autogroup scheduling, tasks sharing one session share one slice of the CPU.
            tasks.append(subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent))
    failed = 0
    while None in (codes := [t.poll() for t in tasks]):  # poll every task: a list, not a short-circuit any()
        bad = [c for c in codes if c not in (None, 0)]
        if bad and kill_on_bad_exit:
            failed = bad[0]
            print(
                f"srun: error: a task exited with code {failed}; terminating the job step (--kill-on-bad-exit)",
                file=sys.stderr,
                flush=True,
            )
            for t in tasks:
                if t.poll() is None:
                    t.send_signal(signal.SIGKILL)
            break
        time.sleep(0.2)
    codes = [t.wait() for t in tasks]
    return failed or next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit(_sbatch(rest[0]) if command == "sbatch" else _srun(rest))
