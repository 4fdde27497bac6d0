"""A peer rank's process ended mid-job: one line naming it (and its signal, where knowable) and the checkpoints kept.

A rank killed by a signal (``kill -9``, the kernel's OOM killer, a node going away) writes nothing;
the survivors only see a collective fail (gloo: "Connection closed by peer"). Without this line
their error was whatever they were doing at that moment (during a save: a checkpoint error that
blamed the disk) and a long traceback.

Who knows the signal: under Lightning's process launcher rank 0 *is* the launcher's process and
holds its children's ``subprocess.Popen`` objects (``_SubprocessScriptLauncher.procs``); a negative
return code is the signal that ended that rank. Under torchrun or srun the agent holds them, and
torchrun prints its own report ("exitcode: -9 ... Signal 9 (SIGKILL) received"); a survivor there
names the peer only when the job has two ranks, and points at that report otherwise.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

_job: dict[str, Any] = {"rank": None, "world_size": None, "launcher": None}


def remember(rank: int, world_size: int, launcher: Any) -> None:
    """Called by ``TitanStrategy`` once its process group is up: the facts the teardown may erase."""
    _job.update(rank=rank, world_size=world_size, launcher=launcher)


def ended_children(wait_s: float = 2.0) -> list[tuple[int, int]]:
    """(global rank, return code) of this process's Lightning-launched ranks that ended with a non-zero code.

    Waits up to ``wait_s`` for a child whose connection just closed to be reaped.
    """
    procs = list(getattr(_job["launcher"], "procs", None) or [])
    if not procs:
        return []
    first = int(os.environ.get("NODE_RANK", "0") or 0) * (len(procs) + 1)  # rank 0 of this node is this process
    deadline = time.monotonic() + wait_s
    while True:
        ended = [(first + i + 1, p.returncode) for i, p in enumerate(procs) if p.poll() is not None and p.returncode]
        if ended or time.monotonic() > deadline:
            return ended
        time.sleep(0.05)


def how(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def this_rank() -> int:
    rank = _job["rank"]
    return int(rank) if rank is not None else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def world_size() -> int | None:
    return _job["world_size"]


def describe(ended: list[tuple[int, int]]) -> str:
    """Who ended: from the launcher's children, else the only other rank of a two-rank job, else "a peer"."""
    if ended:
        rank, code = ended[0]
        more = f" (and {len(ended) - 1} more rank(s))" if len(ended) > 1 else ""
        return f"rank {rank}'s process {how(code)}{more}"
    if world_size() == 2:
        return f"rank {1 - this_rank()}'s process ended (its connection closed; the launcher's report gives its exit code or signal)"
    return "a peer rank's process ended (its connection closed; the launcher's report names the rank and its exit code or signal)"


def checkpoints_state(run_dir: str | None) -> str:
    """``" while checkpoint X was being written ...; the previous complete checkpoint Y is kept"``: the save the
    failure interrupted (a ``.partial`` newer than every complete checkpoint), and the newest complete one."""
    if not run_dir:
        return ""
    from lit_titan.checkpoint.layout import PARTIAL_SUFFIX, checkpoint_step, published, staged_step

    ckpts = Path(run_dir) / "checkpoints"
    done = published(ckpts)
    newest = checkpoint_step(done[-1]) if done else -1
    interrupted = sorted(
        (staged_step(p) or -1, p.name.removesuffix(PARTIAL_SUFFIX))
        for p in ckpts.glob(f"step-*{PARTIAL_SUFFIX}")
        if (staged_step(p) or -1) > (newest or -1)
    )
    during = f" while checkpoint {interrupted[-1][1]} was being written (it is not published)" if interrupted else ""
    kept = f"the previous complete checkpoint {done[-1].name} is kept" if done else "no complete checkpoint yet"
    return f"{during}; {kept}"
