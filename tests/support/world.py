"""One gloo world of N processes, started once per test session and reused by many cases.

Why: a multi-process case run through the command line pays, per case, N fresh interpreters
importing torch + Lightning + Hydra (~6-9 s each on 2 cores) and a new gloo world; the training
itself takes a second or two. Here N worker processes start once, import everything, join one
gloo process group, and then run case after case *in-process*: each case builds its own Trainer
and TitanStrategy through the real entry point (``lit_titan.train.main``), exactly what the
command line runs after its imports. Lightning sees ``LOCAL_RANK`` and treats the processes as
externally launched (as under torchrun), and the strategy finds the process group already up.

Isolation between cases: the environment is restored to the world's own before each case,
process-global torch switches a case may flip (deterministic algorithms, compile caches) are reset,
and after each case every rank passes a barrier. A case that raises on any rank, or does not
finish in time, tears the whole world down (its ranks may be stuck in a collective); the next
case starts a fresh one. The command line keeps its own end-to-end tests (README commands,
torchrun restarts, launch paths, one-line errors).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import queue
import shlex
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Variables a case may set in its process (Lightning's seeds, our run directory, Lightning's
# environment teardown deletes WORLD_SIZE): restored to the world's own before each case.
_CASE_ENV_DROP = (
    "LIT_TITAN_RUN_DIR",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "GROUP_RANK",
    "GLOBAL_RANK",
)
_READY_TIMEOUT_S = 300
# Every fit in a world creates sub-groups (the mesh's dims and flattened views, the checkpoint
# writer's, the pre-flight's) that outlive it: the world owns the default group, so the strategy
# does not tear the groups down. Destroying them at teardown was tried: torch's DTensor caches
# (sharding propagation, redistribute plans) key on a mesh by its layout and hand the next fit the
# earlier mesh, whose groups are then gone ("Could not resolve the process group"). Each idle gloo
# group keeps three threads that cost about 0.4 ms of CPU per second (measured: 300 groups, 1.19 s
# per 10 s per rank), and a CI run reached 1,016 threads per rank in the 4-process world: about a
# core of the 2-core machine, load average 220-390, the suite 45.6 min instead of ~28. So a world
# whose ranks hold more threads than this is replaced before its next case. A fit adds about 27
# threads per rank (9 groups) and a 4-process world starts in about 8.5 s: at 400 a world is
# replaced every ~14 fits, while its groups never drain more than ~0.2 core. The budget is per world
# (ranks x threads): an 8-process world idles on twice the threads of a 4-process one at the same count.
MAX_THREADS = 400
MAX_WORLD_THREADS = 4 * MAX_THREADS
# A world not used for this long is closed when another is asked for: measured (top) in a CI run, an idle
# 8-process world kept for the rest of the session after its few cases held 243 threads per rank at 5.3% of
# a core each (about 0.4 core of the 2-core machine, for half an hour), against the seconds a start costs.
WORLD_IDLE_S = 60.0


@dataclass
class CaseResult:
    """What rank 0 returned and printed; shaped like subprocess.CompletedProcess for the tests."""

    value: Any
    output: str  # rank 0's stdout and stderr, interleaved as written

    returncode = 0

    @property
    def stdout(self) -> str:
        return self.output

    stderr = stdout


class CaseFailed(AssertionError):
    pass


class World:
    """N spawned processes in one gloo process group; ``run`` executes a function on every rank."""

    def __init__(self, size: int, timeout_s: int = 180) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"world{size}-"))
        self._results: mp.Queue = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(size)]
        port = _free_port()
        # Not daemonic: a case may start processes of its own (loader workers, DCP's process mode).
        self._procs = [
            ctx.Process(
                target=_worker,
                name=f"world{size}-rank{rank}",
                args=(rank, size, port, timeout_s, self.log_dir, self._inboxes[rank], self._results),
            )
            for rank in range(size)
        ]
        for p in self._procs:
            p.start()
        self._cases = 0
        self._collect("ready", _READY_TIMEOUT_S)
        self.last_used = time.monotonic()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def threads(self) -> int:
        """The most OS threads any rank holds now (Linux ``/proc``; 0 where it cannot be read)."""
        counts = [0]
        for p in self._procs:
            with contextlib.suppress(OSError, ValueError):
                status = Path(f"/proc/{p.pid}/status").read_text()
                counts.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:"))))
        return max(counts)

    def run(self, target: str, *args: Any, timeout: float = 600, allow_noise: tuple[str, ...] = ()) -> CaseResult:
        """Run ``module:function(*args)`` on every rank; rank 0's return value and output.

        Every rank's log of a case that succeeds is read by the first-run test's matcher
        (``helpers.noise``): a warning, traceback or tip on any rank fails the case, unless its line
        contains one of ``allow_noise`` (a case that asks for a warning). A case that fails raises
        ``CaseFailed`` with its traceback instead (the tests that expect an error catch that).
        """
        self._cases += 1
        case = f"case-{self._cases:04d}"
        for inbox in self._inboxes:
            inbox.put((case, target, args))
        try:
            replies = self._collect(case, timeout)
        finally:
            self.last_used = time.monotonic()
        output = (self.log_dir / f"{case}-rank0.log").read_text(errors="replace")
        self._check_noise(case, allow_noise)
        return CaseResult(replies[0][1], output)

    def _check_noise(self, case: str, allow: tuple[str, ...]) -> None:
        from helpers import noise  # tests/support is on sys.path (pytest's pythonpath; spawned workers inherit it)

        found = []
        for log in sorted(self.log_dir.glob(f"{case}-rank*.log")):
            lines = [
                line
                for line in noise(log.read_text(errors="replace"))
                if not line.startswith("$ ") and not any(a in line for a in allow)
            ]  # "$ ": the case's echo
            found += [f"{log.name}: {line}" for line in lines]
        if found:  # the world itself is fine: it stays up for the next case
            raise CaseFailed(
                f"{case} in a {self.size}-process world printed {len(found)} unexpected warning or "
                "traceback line(s); fix the cause, or add a dependency's message a user cannot act on "
                "to lit_titan/known_warnings.py:\n" + "\n".join(found[:40]) + f"\n{self._tail_logs(case)}"
            )

    def _collect(self, case: str, timeout: float) -> dict[int, tuple[bool, Any]]:
        replies: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.size:
            try:
                rank, got_case, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                if not self.alive or time.monotonic() > deadline:
                    why = "a rank died" if not self.alive else f"no result within {timeout:.0f}s"
                    self.close()
                    failed = "".join(f"\nrank {r} failed:\n{v}" for r, (ok, v) in sorted(replies.items()) if not ok)
                    raise CaseFailed(
                        f"{case} in a {self.size}-process world: {why}; ranks that answered: "
                        f"{sorted(replies)}{failed}\n{self._tail_logs(case)}"
                    ) from None
                continue
            if got_case != case:
                continue  # a late answer of an earlier, abandoned case
            replies[rank] = (ok, value)
            if not ok:  # the other ranks may be stuck in a collective: give them a moment, then stop
                deadline = min(deadline, time.monotonic() + 20)
        failed = {r: v for r, (ok, v) in replies.items() if not ok}
        if failed:
            self.close()
            rank, tb = min(failed.items())
            raise CaseFailed(f"{case} failed on rank(s) {sorted(failed)}; rank {rank}:\n{tb}\n{self._tail_logs(case)}")
        return replies

    def _tail_logs(self, case: str) -> str:
        parts = []
        for log in sorted(self.log_dir.glob(f"{case}-rank*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


class Worlds:
    """One live World per process count, created on first use and replaced after a failure."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def get(self, size: int) -> World:
        now = time.monotonic()
        for other in [n for n, w in self._worlds.items() if n != size and now - w.last_used > WORLD_IDLE_S]:
            self._worlds.pop(other).close()  # see WORLD_IDLE_S
        world = self._worlds.get(size)
        if world is not None and world.alive and world.threads() * size > MAX_WORLD_THREADS:
            world.close()  # see MAX_THREADS: a fresh world costs a few seconds, the old one a core
        if world is None or not world.alive:
            world = self._worlds[size] = World(size)
        return world

    def run(
        self, size: int, target: str, *args: Any, timeout: float = 600, allow_noise: tuple[str, ...] = ()
    ) -> CaseResult:
        return self.get(size).run(target, *args, timeout=timeout, allow_noise=allow_noise)

    def train(
        self, overrides: list[str], run_dir: Path | str, *, timeout: float = 600, allow_noise: tuple[str, ...] = ()
    ) -> CaseResult:
        """``python -m lit_titan.train OVERRIDES run_dir=RUN_DIR`` in the world of ``cluster.devices`` ranks."""
        size = devices_of(overrides)
        return self.run(
            size, "world:train_case", [*overrides, f"run_dir={run_dir}"], timeout=timeout, allow_noise=allow_noise
        )

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


def devices_of(overrides: list[str]) -> int:
    """The process count a command line asks for (the last ``cluster.devices=`` wins, as in Hydra)."""
    devices = 1
    for item in overrides:
        if item.startswith("cluster.devices="):
            devices = int(item.split("=", 1)[1])
    return devices


# ---- cases (run inside the workers) ---------------------------------------------------------------
def train_case(argv: list[str]) -> dict[str, Any]:
    """The command line's job, minus its process start: ``lit_titan.train.main(argv)``."""
    from lit_titan.train import main

    print(f"$ python -m lit_titan.train {shlex.join(argv)}", flush=True)
    return main(argv)


# ---- the worker -----------------------------------------------------------------------------------
def _worker(rank: int, size: int, port: int, timeout_s: int, log_dir: Path, inbox: mp.Queue, results: mp.Queue) -> None:
    for key in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "LOCAL_WORLD_SIZE",
        *_CASE_ENV_DROP,
    ):
        os.environ.pop(key, None)
    # Lightning's LightningEnvironment takes LOCAL_RANK as "launched externally" (no re-spawn).
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(size),
    )
    # A spawned child inherits the "spawn" start method (multiprocessing's spawn.prepare sets it), so
    # the cases' loader workers would each start an interpreter and import torch + lit_titan (measured:
    # dp4 x 2 workers, 57-61 s a case against 6-8 s without workers). A rank that torchrun or the command
    # line starts uses the platform's default (fork on Linux); the world's ranks do the same.
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import lit_titan.train  # noqa: F401  (imported once: what every case would otherwise pay)

    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    base_env, threads = dict(os.environ), torch.get_num_threads()
    results.put((rank, "ready", True, None))
    parent = os.getppid()
    while (msg := _next_case(inbox, parent)) is not None:
        case, target, args = msg
        _reset_process_state(base_env, threads)
        try:
            with _redirect_output(log_dir / f"{case}-rank{rank}.log"):
                value = _resolve(target)(*args)
                dist.barrier()  # every rank finished the case: the world is in step for the next
            results.put((rank, case, True, value))
        except BaseException:  # noqa: BLE001 - reported to the parent, which tears the world down
            results.put((rank, case, False, traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: it can wait on peers that are already gone


def _next_case(inbox: mp.Queue, parent: int) -> Any:
    """The next case, or None when the session closes the world or has died (killed pytest: OOM, timeout).

    An orphaned world would otherwise hold its memory (about 0.6 GB per rank) until the machine restarts.
    """
    while True:
        try:
            return inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _reset_process_state(base_env: dict[str, str], threads: int) -> None:
    """Undo what an earlier case may have changed in this process (what a fresh process would not have)."""
    import gc

    import torch

    os.environ.clear()
    os.environ.update(base_env)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()


@contextlib.contextmanager
def _redirect_output(path: Path):
    """Send this process's stdout and stderr (Python and C level) to ``path`` for one case."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab", buffering=0) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
