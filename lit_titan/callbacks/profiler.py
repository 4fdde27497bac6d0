"""torch.profiler traces of chosen optimizer steps, per rank, and CUDA memory snapshots.

``callbacks=[throughput,timeline,profiler] callbacks.profiler.steps=[3,4]`` profiles optimizer
steps 3 and 4 (counted from 1, as in ``metrics.csv``'s rows: step ``s`` is the one after which
``global_step == s``), after ``warmup`` steps that run the profiler without recording (its own
start-up cost stays out of the trace). ``every_n_steps=N`` profiles ``active`` steps from every
N-th step instead. Each rank writes a Chrome trace (open in chrome://tracing or
https://ui.perfetto.dev):

    <run_dir>/profile/step-<first step>/rank-<R>.json.gz

The named ranges ``lit_titan/data``, ``/forward``, ``/backward``, ``/pipeline`` (the schedule),
``/grad_clip``, ``/optimizer`` and ``/checkpoint`` (staging) come from the Timeline callback's
phases (:mod:`lit_titan.observe.phases`). Outside the window the callback does nothing but compare
two integers per step.

On CUDA, the allocator's history is recorded through the window and dumped next to the trace
(``rank-<R>.memory.pickle``, for https://pytorch.org/memory_viz), and with ``oom_snapshot`` the
history is kept from the start and dumped to ``<run_dir>/memory/oom-rank-<R>.pickle`` when an
allocation fails.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lit_titan.callbacks.settings import ProfilerConfig
from lit_titan.settings import settings_of

__all__ = ["Profiler", "profile_windows"]

log = logging.getLogger(__name__)


def profile_windows(
    max_steps: int, steps: list[int] | None, every_n_steps: int | None, active: int
) -> list[tuple[int, int]]:
    """The ``(first, last)`` optimizer steps to profile, checked against the run's ``max_steps``.

    Raises ValueError naming the setting when a window lies outside ``1..max_steps``.
    """
    if steps is not None and every_n_steps is not None:
        raise ValueError("callbacks.profiler: set steps=[FIRST,LAST] or every_n_steps=N, not both")
    if steps is not None:
        if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1]:
            raise ValueError(
                f"callbacks.profiler.steps={list(steps)} must be [FIRST,LAST] optimizer steps with "
                f"1 <= FIRST <= LAST, e.g. callbacks.profiler.steps=[3,4]"
            )
        if max_steps > 0 and steps[1] > max_steps:
            raise ValueError(
                f"callbacks.profiler.steps={list(steps)} ends after the run's last step "
                f"(trainer.max_steps={max_steps}); choose steps within 1..{max_steps}"
            )
        return [(int(steps[0]), int(steps[1]))]
    if every_n_steps is not None:
        if every_n_steps < 1 or active < 1:
            raise ValueError("callbacks.profiler.every_n_steps and callbacks.profiler.active must be >= 1")
        if max_steps > 0 and every_n_steps + active - 1 > max_steps:
            raise ValueError(
                f"callbacks.profiler.every_n_steps={every_n_steps} never profiles a whole window "
                f"within trainer.max_steps={max_steps}; use a smaller every_n_steps"
            )
        last = max_steps if max_steps > 0 else 10**9
        return [(s, s + active - 1) for s in range(every_n_steps, last - active + 2, every_n_steps)]
    raise ValueError("callbacks.profiler needs steps=[FIRST,LAST] or every_n_steps=N")


class Profiler(L.Callback):
    """Chrome traces of the chosen optimizer steps on every rank (and CUDA memory snapshots).

    Takes a ``ProfilerConfig`` (``callbacks/settings.py``) or its fields by name:
        steps: ``[first, last]`` optimizer steps to record (from 1).
        every_n_steps: instead, record ``active`` steps from every N-th step.
        active: steps per window with ``every_n_steps``.
        warmup: steps before a window that run the profiler without recording.
        record_shapes, with_stack, profile_memory: passed to ``torch.profiler.profile``.
        memory_snapshot: on CUDA, record the allocator's history through each window and dump it.
        oom_snapshot: on CUDA, keep the allocator's history and dump it when an allocation fails.
        run_dir: where ``profile/`` goes (None: the run directory).
    """

    def __init__(self, settings: ProfilerConfig | None = None, **keys: Any) -> None:
        s = self.settings = settings_of(ProfilerConfig, settings, keys)
        self.steps = list(s.steps) if s.steps is not None else None
        self.every_n_steps = s.every_n_steps
        self.active = int(s.active)
        self.warmup = max(0, int(s.warmup))
        self.record_shapes, self.with_stack, self.profile_memory = s.record_shapes, s.with_stack, s.profile_memory
        self.memory_snapshot, self.oom_snapshot = s.memory_snapshot, s.oom_snapshot
        self.run_dir = s.run_dir
        self.traces: list[Path] = []  # written by this process
        self._windows: list[tuple[int, int]] = []
        self._prof: Any = None
        self._window: tuple[int, int] | None = None
        self._rank = 0
        self._root = Path(".")
        self._cuda = False
        self._prev_global_step = 0
        profile_windows(0, self.steps, self.every_n_steps, self.active)  # bad settings fail at instantiation

    def check(self, max_steps: int) -> None:
        """Refuse windows outside the run (called by config validation, before anything is built)."""
        profile_windows(max_steps, self.steps, self.every_n_steps, self.active)

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._windows = [
            w
            for w in profile_windows(trainer.max_steps, self.steps, self.every_n_steps, self.active)
            if w[1] > trainer.global_step
        ]  # a resumed run skips windows already past
        self._rank = trainer.global_rank
        self._root = Path(self.run_dir or trainer.default_root_dir).expanduser()
        self._cuda = trainer.strategy.root_device.type == "cuda"
        if self._cuda and self.oom_snapshot:
            self._watch_oom()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._prof is not None or not self._windows:
            return
        upcoming = trainer.global_step + 1  # the optimizer step this batch belongs to
        first, last = self._windows[0]
        if upcoming < first - self.warmup:
            return
        self._prev_global_step = trainer.global_step
        self._start((first, last), warmup=max(0, first - upcoming))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._prof is None or self._window is None:
            return
        if trainer.global_step == self._prev_global_step:  # inside an accumulation window: not a step yet
            return
        self._prev_global_step = trainer.global_step
        self._prof.step()
        if trainer.global_step >= self._window[1]:
            self._stop()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    # ---- helpers --------------------------------------------------------------------------------
    def _start(self, window: tuple[int, int], warmup: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self._window = window
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=window[1] - window[0] + 1, repeat=1),
            on_trace_ready=self._export,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
            profile_memory=self.profile_memory,
        )
        self._prof.start()
        if self._cuda and self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()  # exports through on_trace_ready if the window was reached
        if self._cuda and self.memory_snapshot and self._window is not None:
            path = self._dir(self._window) / f"rank-{self._rank}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            if not self.oom_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)
        self._windows = [w for w in self._windows if w != self._window]
        self._window = None

    def _dir(self, window: tuple[int, int]) -> Path:
        path = self._root / "profile" / f"step-{window[0]:06d}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _export(self, prof: Any) -> None:
        assert self._window is not None
        path = self._dir(self._window) / f"rank-{self._rank}.json.gz"
        prof.export_chrome_trace(str(path))  # gzip-compressed by the ".gz" suffix
        self.traces.append(path)
        if self._rank == 0:
            log.warning(f"lit-titan profiler: steps {self._window[0]}-{self._window[1]} traced to {path.parent}")

    def _watch_oom(self) -> None:
        # PyTorch's documented recipe (torch.cuda memory docs, "Understanding CUDA Memory Usage"):
        # keep the allocator's history and snapshot it from the out-of-memory observer.
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        root, rank = self._root, self._rank

        def dump(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
            path = root / "memory" / f"oom-rank-{rank}.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            log.error(
                f"lit-titan: CUDA out of memory on rank {rank}; allocator snapshot in {path} "
                f"(open it at https://pytorch.org/memory_viz)"
            )

        torch._C._cuda_attach_out_of_memory_observer(dump)
