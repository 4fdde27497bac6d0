"""Hang watchdog: when a rank stops making progress, dump its Python stacks and exit non-zero.

A hung job (a rank stuck in Python, a collective that never completes, a dead NFS mount) burns
the whole allocation silently until the process group's timeout, and then dies without saying
where it was stuck. ``Watchdog`` runs a daemon thread on every rank that watches the time since
this rank last made progress (a training or validation batch finished, a checkpoint save started,
or someone called :meth:`Watchdog.beat`). After ``timeout_s`` without progress it

1. writes every thread's Python stack of this rank to ``<run_dir>/hang/stacks-rank<R>.txt``
   (``faulthandler.dump_traceback(all_threads=True)`` plus the same stacks with source lines),
   the c10d flight recorder's buffer of this rank's last collectives (``fr-trace-rank<R>.json``
   on gloo, ``nccl-trace-rank<R>.pickle`` on NCCL; :mod:`lit_titan.observe.flight_recorder`)
   and a small ``<run_dir>/hang/rank<R>.json`` (step, last progress, seconds since, pid, host,
   the newest collectives: compare them across ranks to see who is missing from which one);
2. prints one line to stderr;
3. waits ``exit_delay_s`` (so that peers stuck in the same collective dump their stacks before
   this rank's exit breaks their connections), then ``os._exit(WATCHDOG_EXIT_CODE)``.

A non-zero exit makes Lightning's launcher kill the other ranks and torchrun's agent tear the job
down and, with ``--max-restarts``, restart it. The watchdog uses no collectives: each rank's
watchdog fires on its own (a hung collective hangs every rank, so every rank dumps).

If the main thread holds the GIL forever (a C extension spinning without releasing it), this
Python thread cannot run; a C-level ``faulthandler.dump_traceback_later`` backstop, re-armed by
the thread, then dumps the stacks to stderr and exits with code 1 ``backstop_s`` seconds later.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L

from lit_titan.callbacks.settings import WATCHDOG_EXIT_CODE, WatchdogConfig
from lit_titan.settings import settings_of

__all__ = ["WATCHDOG_EXIT_CODE", "Watchdog"]

_ACTIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class Watchdog(L.Callback):
    """Exit non-zero with every thread's stack when this rank makes no progress for ``timeout_s``.

    The clock starts at ``on_train_start`` (process start-up, data preparation, model build and
    the sanity check are not watched) and stops at ``teardown`` or on an exception. Until the first
    training batch of the fit has finished, ``first_step_timeout_s`` applies instead: the first
    step may compile, fast-forward a resumed data loader or warm up caches.

    Progress: every training and validation batch end, validation start, every checkpoint save
    (``on_save_checkpoint``, called when a save begins: a synchronous save must finish within
    ``timeout_s``, or be wrapped in :meth:`paused`). Code outside the hooks signals progress with
    :meth:`beat` or, without a reference to the callback, :meth:`Watchdog.heartbeat`.

    Takes a ``WatchdogConfig`` (``callbacks/settings.py``) or its fields by name:
        timeout_s: seconds without progress before the rank dumps its stacks and exits.
        first_step_timeout_s: the allowance for the first training batch (None: ``timeout_s``).
        run_dir: where ``hang/`` goes (None: the trainer's ``default_root_dir``, the run dir
            under ``python -m lit_titan.train``).
        exit_code: the process exit status when the watchdog fires (default 75, EX_TEMPFAIL).
        exit_delay_s: seconds between dumping and exiting, so peers can dump too.
        backstop_s: extra seconds for the C-level backstop (None disables it; it takes over
            ``faulthandler.dump_traceback_later``, of which a process has one).
    Not a config key: ``poll_interval_s``, how often the thread checks (None: ``timeout_s / 20``, 0.1 to 5 s).
    """

    def __init__(
        self, settings: WatchdogConfig | None = None, *, poll_interval_s: float | None = None, **keys: Any
    ) -> None:
        s = self.settings = settings_of(WatchdogConfig, settings, keys)
        timeout_s, first_step_timeout_s, exit_code = s.timeout_s, s.first_step_timeout_s, s.exit_code
        if timeout_s <= 0 or (first_step_timeout_s is not None and first_step_timeout_s <= 0):
            raise ValueError("Watchdog timeouts must be > 0 seconds")
        if exit_code == 0:
            raise ValueError("Watchdog exit_code must be non-zero, or a launcher would not restart the job")
        self.timeout_s = float(timeout_s)
        self.first_step_timeout_s = float(first_step_timeout_s or timeout_s)
        self.run_dir = s.run_dir
        self.exit_code = int(exit_code)
        self.exit_delay_s = max(0.0, float(s.exit_delay_s))
        self.poll_interval_s = float(poll_interval_s or min(5.0, max(0.1, self.timeout_s / 20)))
        self.backstop_s = s.backstop_s
        self.rank = 0
        self.hang_dir: Path | None = None
        # (monotonic time, what, global step) of the last progress; replaced whole, read by the thread.
        self._last: tuple[float, str, int] = (time.monotonic(), "created", 0)
        self._first_step_done = False
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_armed = False

    # ---- public API -----------------------------------------------------------------------------
    def beat(self, what: str = "progress", step: int | None = None) -> None:
        """Record progress now (cheap: one tuple assignment; safe from any thread)."""
        self._last = (time.monotonic(), what, self._last[2] if step is None else int(step))

    @classmethod
    def heartbeat(cls, what: str = "progress") -> None:
        """Record progress on every running watchdog of this process (for code without a reference)."""
        for dog in list(_ACTIVE):
            dog.beat(what)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Do not fire inside this block (e.g. a long synchronous save); the clock restarts after it."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat("resumed after a paused block")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rank = int(trainer.global_rank)
        self.hang_dir = Path(self.run_dir or trainer.default_root_dir).expanduser() / "hang"
        self._first_step_done = False
        self.beat("train start", trainer.global_step)
        self.start()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.beat("train epoch start", trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._first_step_done = True
        self.beat("train batch end", trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.beat("validation start", trainer.global_step)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.beat("validation batch end", trainer.global_step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.beat("validation end", trainer.global_step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.beat("checkpoint save start", trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.beat("train end", trainer.global_step)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.stop()  # the exception ends the job on its own; do not dump over its traceback

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop()

    # ---- the thread -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start (or restart) the watching thread; called by ``on_train_start``."""
        self.stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop,), name="lit-titan-watchdog", daemon=True)
        _ACTIVE.add(self)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (idempotent); called at teardown and on exceptions."""
        self._stop.set()
        _ACTIVE.discard(self)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, 2 * self.poll_interval_s))
        self._disarm_backstop()

    def _deadline(self) -> float:
        return self.timeout_s if self._first_step_done else self.first_step_timeout_s

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(self.poll_interval_s):
            if self._paused:
                self._disarm_backstop()
                continue
            last, _, _ = self._last
            idle, deadline = time.monotonic() - last, self._deadline()
            if idle > deadline:
                if not stop.is_set():
                    self._fire(idle)
                return
            if not stop.is_set():
                self._arm_backstop(deadline - idle + self.poll_interval_s)

    def _arm_backstop(self, remaining: float) -> None:
        if self.backstop_s is None:
            return
        # Re-armed on every poll: fires only if this thread stopped running (GIL held forever).
        faulthandler.dump_traceback_later(remaining + float(self.backstop_s), exit=True, file=sys.__stderr__)
        self._backstop_armed = True

    def _disarm_backstop(self) -> None:
        if self._backstop_armed:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_armed = False

    def _fire(self, idle: float) -> None:
        self._disarm_backstop()
        _, what, step = self._last
        stacks = None
        try:
            stacks = self._dump(idle, what, step)
        except Exception as err:  # never let a full disk keep a hung job alive
            _stderr(f"lit-titan watchdog: rank {self.rank}: could not write stacks ({err!r}); dumping to stderr")
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        where = f"stacks in {stacks}" if stacks else "stacks on stderr"
        _stderr(
            f"lit-titan watchdog: rank {self.rank} made no progress for {idle:.1f} s (timeout "
            f"{self._deadline():g} s; last progress: {what} at global_step {step}); {where}; "
            f"exiting with code {self.exit_code} in {self.exit_delay_s:g} s"
        )
        self._exit()

    def _exit(self) -> None:
        # os._exit: no atexit handlers, no joins -- the main thread is stuck, a clean exit would hang.
        time.sleep(self.exit_delay_s)
        os._exit(self.exit_code)

    def _dump(self, idle: float, what: str, step: int) -> Path:
        assert self.hang_dir is not None
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        stacks = self.hang_dir / f"stacks-rank{self.rank}.txt"
        names = {t.ident: t.name for t in threading.enumerate()}
        with open(stacks, "w") as f:
            f.write(
                f"# lit-titan watchdog: rank {self.rank} (pid {os.getpid()}, {socket.gethostname()}), no progress "
                f"for {idle:.1f} s; last progress: {what} at global_step {step}\n# threads: "
                + ", ".join(f"{ident:#x} = {name}" for ident, name in names.items())
                + "\n\n"
            )
            f.flush()
            # faulthandler first: it needs no locks, so it works even if formatting below would not.
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n# the same stacks with source lines (most recent call last)\n")
            for ident, frame in sys._current_frames().items():
                f.write(f"\n## thread {ident:#x} ({names.get(ident, '?')})\n")
                f.write("".join(traceback.format_stack(frame)))
        from lit_titan.observe import flight_recorder

        trace, last = flight_recorder.dump(self.hang_dir, self.rank)
        info = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "global_step": step,
            "last_progress": what,
            "seconds_since_progress": round(idle, 3),
            "timeout_s": self._deadline(),
            "exit_code": self.exit_code,
            "stacks": str(stacks),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "flight_recorder": str(trace) if trace else None,
            "last_collectives": last,
        }
        (self.hang_dir / f"rank{self.rank}.json").write_text(json.dumps(info, indent=1) + "\n")
        return stacks


def _stderr(line: str) -> None:
    """Write a line with os.write: no Python lock that the hung main thread might hold."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
