"""Which rank this process is, how a rank reports a failure in one line, and how a finished rank exits.

What a run needs whatever started it (a command, a notebook, torchrun): the commands' exit-code
wrapper (lit_titan/cli/entry.py) calls these, and so do the run's builders (only rank 0 speaks).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from lit_titan.errors import error_line, is_peer_failure, one_line

QUIET_RANK_EXIT_DELAY_S = 5.0  # see report_user_error and report_peer_failure


def wait_for_parent(pid: int, timeout_s: float = 60.0) -> None:
    """Return once process ``pid`` is no longer this process's parent (it exited), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while os.getppid() == pid and time.monotonic() < deadline:
        time.sleep(0.05)


def exit_rank(code: int) -> None:
    """End a rank of a finished multi-process job: its threads and exit handlers run, interpreter teardown does not.

    Why: after ``destroy_process_group()`` torch's DTensor caches (sharding propagation, redistribute
    planners) still hold the fit's DeviceMeshes, and through them its gloo process groups. Those are
    then destroyed during interpreter teardown, where a gloo thread can be destroyed while joinable:
    "terminate called without an active exception", SIGABRT, and torchrun reports a finished job as
    failed (or restarts it). Seen in 2 of 6 CI runs of the torchrun kill-restart test, after the run
    summary was printed. Thread pools are stopped, non-daemon threads joined and ``atexit`` handlers
    run (W&B, logging, multiprocessing's children), so only the interpreter's teardown is skipped.
    """
    import atexit
    import threading

    # What Py_Finalize runs before its teardown, in its order: threading's exit hooks (idle thread
    # pools are told to stop) and the joins of non-daemon threads, then the atexit handlers. Both
    # are CPython's underscored functions, unchanged from Python 3.9 to 3.13.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_rank_of_a_job() -> bool:
    """This process is one rank of a multi-process job, even after its process group is gone.

    torchrun sets ``WORLD_SIZE``, srun ``SLURM_NTASKS``; Lightning's own launcher leaves ``LOCAL_RANK``
    set on every rank (its environment's teardown removes ``WORLD_SIZE``). A one-process run has none.
    """
    env = os.environ
    return job_rank() is not None or "LOCAL_RANK" in env or int(env.get("SLURM_NTASKS", "1") or 1) > 1


def job_rank() -> int | None:
    """This process's global rank in a job of several processes; None in a single-process run."""
    dist = sys.modules.get("torch.distributed")  # never imported: no process group (and `--help` stays fast)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() if dist.get_world_size() > 1 else None
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return None


def report_rank_failure(err: BaseException) -> Path:
    """One line naming the rank and the file with its full traceback, instead of a traceback per rank.

    The launcher (torchrun's agent, Lightning's process observer, Slurm) ends the other ranks when
    this one exits; each failing rank prints its own line, so the first cause is not lost.
    """
    import traceback

    rank = job_rank() or 0
    run_dir = os.environ.get("LIT_TITAN_RUN_DIR")
    log_dir = Path(run_dir) / "logs" if run_dir else Path(tempfile.gettempdir()) / "lit-titan-logs"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"rank-{rank}-error.txt"
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        from lit_titan.observe.redact import write_private

        write_private(path, scrub(text))  # a traceback may quote the config: the user's only, no credentials
        where = f"full traceback in {path}"
    except OSError as write_err:  # the failure may be the disk itself: the traceback then goes to stderr
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        path, where = Path("-"), f"traceback above (could not write {log_dir}: {write_err.strerror})"
    if is_peer_failure(err) and _another_rank_reported(log_dir, rank):
        return path  # this rank only lost its peer: the first cause has its own line
    summary = one_line(scrub(f"{type(err).__name__}: {err}"))[:300]
    print(error_line(f"rank {rank} failed: {summary}; {where}"), file=sys.stderr, flush=True)
    return path


def report_peer_failure() -> None:
    """One line when this rank failed only because a peer's process ended (``lit_titan.observe.peer_exit``).

    Printed by rank 0 (or, in a two-rank job, by the survivor of rank 0): under Lightning's launcher
    rank 0 holds the other ranks' processes and names the rank and the signal. Quiet under torchrun,
    whose agent reports the ended rank itself. Quiet when the peer
    ended on an error of its own, which it reported in its own line.
    """
    from lit_titan.observe import peer_exit

    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun's agent names the ended rank with its exit code or signal and stops the survivors with
        # SIGTERM; a survivor that sees the closed connection before that SIGTERM lands would add a second,
        # vaguer line (it did in CI, one run in several), so under torchrun the agent's line is the report.
        # Stay up until that SIGTERM (bounded): the agent names the failure with the earliest timestamp
        # among the ranks that have ended when it looks, and a survivor that ended first was named in
        # place of the killed rank (exit code 1 instead of its signal, in CI, one run in several).
        _wait_for_sigterm(QUIET_RANK_EXIT_DELAY_S)
        return
    rank = peer_exit.this_rank()
    run_dir = os.environ.get("LIT_TITAN_RUN_DIR")
    log_dir = Path(run_dir) / "logs" if run_dir else Path(tempfile.gettempdir()) / "lit-titan-logs"
    ended = peer_exit.ended_children()
    if all(code > 0 for _, code in ended) and _another_rank_reported(log_dir, rank, wait_s=1.0 if ended else 3.0):
        return  # the rank that failed in Python printed its own line (report_rank_failure)
    if rank != 0 and not (peer_exit.world_size() == 2 and not ended):
        return  # rank 0 says it (a survivor of a two-rank job whose peer was rank 0 says it too)
    print(
        error_line(
            f"{peer_exit.describe(ended)}{peer_exit.checkpoints_state(run_dir)}; continue with "
            f"resume=auto (torchrun --max-restarts restarts it by itself; HYDRA_FULL_ERROR=1 shows this "
            f"rank's traceback)"
        ),
        file=sys.stderr,
        flush=True,
    )


class _Stopped(Exception):
    """The launcher's SIGTERM arrived while ``_wait_for_sigterm`` waited for it."""


def _wait_for_sigterm(timeout_s: float) -> None:
    """Sleep until SIGTERM or ``timeout_s``; the caller then exits as it would have (exit code, exit handlers)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        time.sleep(timeout_s)  # only the main thread may take a signal handler
        return

    def stop(signum: int, frame: object) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        time.sleep(timeout_s)
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _another_rank_reported(log_dir: Path, rank: int, wait_s: float = 3.0) -> bool:
    """Whether another rank wrote its error file (the cause of this rank's lost connection), waiting briefly."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        if any(
            p.name != f"rank-{rank}-error.txt" and p.stat().st_mtime > time.time() - 60  # not an earlier attempt's
            for p in log_dir.glob("rank-*-error.txt")
        ):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def report_user_error(err: BaseException) -> None:
    """``lit-titan: error: <message>`` on one line (stderr).

    An error every rank of the job raises together (a bad config, missing data, a failed
    checkpoint save agreed collectively: ``raised_on_every_rank``) is printed once, by the
    launcher's rank 0, not once per rank.
    """
    if getattr(err, "raised_on_every_rank", False) and not is_launcher_rank_zero():
        # Stay up a moment: a launcher (torchrun) ends every rank as soon as one exits, and a quiet
        # rank that exits first can take rank 0 down before its line is printed (seen in CI).
        # The error came before any expensive work, so the wait costs nothing else.
        time.sleep(QUIET_RANK_EXIT_DELAY_S)
        return
    print(error_line(scrub(str(err))), file=sys.stderr, flush=True)


def scrub(text: str) -> str:
    """``text`` with the credentials of this command line (``sys.argv``) as ``***`` (lit_titan/observe/redact.py).

    Error lines quote the override at fault, and they end up in job logs.
    """
    from lit_titan.observe.redact import redact, secrets_of

    try:
        return redact(text, secrets_of(sys.argv[1:]))
    except Exception:  # noqa: BLE001 - a line that cannot be scrubbed is still printed: the error matters more
        return text


def is_launcher_rank_zero() -> bool:
    """Rank 0 of the job under torchrun, Lightning's launcher, or Slurm/submitit tasks (SLURM_PROCID)."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))
