"""Per-rank timeline: where each optimizer step's wall time goes, on every rank, as a CSV.

``<run_dir>/timeline/rank-<R>.csv`` gets one row per optimizer step: the step's wall time (end of
the previous step to the end of this one), the seconds spent in each phase of
:data:`~lit_titan.observe.phases.PHASES`, the rest (``other_s``: Lightning's loop, hooks, logging),
and the step's peak memory (CUDA: allocated and reserved by the caching allocator, reset each step;
CPU: the process's peak RSS so far). The phases add up to the wall time.

Phases and the hooks that bound them:

- ``data``: end of the previous batch to the module's forward (the loader's wait, Lightning's loop
  and batch-start hooks), without ``checkpoint``: the blocking part of a save made after the
  previous step, which therefore shows in the row *after* the step that saved;
- ``forward``: the module's forward to ``on_before_backward``; ``backward``: to ``on_after_backward``
  (summed over the micro-batches of an accumulation window); under pipeline parallelism the
  schedule runs both inside ``training_step``, so that time is ``pipeline``;
- ``grad_clip``: the global gradient norm and clipping (in the module), inside ``optimizer``:
  ``on_before_optimizer_step`` to the optimizer's step post-hook;
- ``validation``: a validation run between two steps (in the row of the step after it).

On CUDA nothing here syncs the host: times come from CUDA events read once the GPU has passed them
(a few steps late; the rest at the end of training), memory from the allocator's host-side counters.
Memory and file handles stay bounded however long the run: rows wait in memory until a logging step
(or ``FLUSH_ROWS`` of them), are appended to the CSV in one open, and only the last ``RECENT_ROWS``
stay in memory afterwards (for the straggler report).
"""

from __future__ import annotations

import csv
import resource
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lit_titan.callbacks.settings import TimelineConfig
from lit_titan.observe.log_cadence import is_logging_step
from lit_titan.observe.phases import PHASES, PhaseClock, StepTimes
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import contract, module_contract

__all__ = ["TIMELINE_COLUMNS", "Timeline"]

TIMELINE_COLUMNS = ("step", "wall_s", *(f"{p}_s" for p in PHASES), "other_s", "peak_mem_mib", "peak_reserved_mib")
RECENT_ROWS = 1024  # rows kept in memory after they are written (~1.5 MB)
FLUSH_ROWS = 256  # rows buffered at most between two writes, whatever the logging interval


class Timeline(L.Callback):
    """Write ``<run_dir>/timeline/rank-<R>.csv``: per optimizer step, wall time by phase and peak memory.

    Takes a ``TimelineConfig`` (``callbacks/settings.py``) or its fields by name:
        run_dir: where ``timeline/`` goes (None: the trainer's ``default_root_dir``, the run dir).
    """

    def __init__(self, settings: TimelineConfig | None = None, **keys: Any) -> None:
        self.settings = settings_of(TimelineConfig, settings, keys)
        self.run_dir = self.settings.run_dir
        self.clock: PhaseClock | None = None
        self.path: Path | None = None
        self.rows: deque[dict[str, Any]] = deque(maxlen=RECENT_ROWS)  # this process's latest rows
        self.rows_total = 0  # rows ever made by this process (``rows`` keeps the last RECENT_ROWS)
        self._pending: list[dict[str, Any]] = []  # made, not yet in the CSV
        self._memory: dict[int, tuple[float, float]] = {}
        self._hooks: list[Any] = []
        self._prev_global_step = 0
        self._pipeline = False

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        self.clock = PhaseClock(device)
        module_contract(pl_module).phase_clock = self.clock  # read by PretrainModule and the strategy
        self._pipeline = contract(trainer.strategy).backward_in_training_step
        self.path = (
            Path(self.run_dir or trainer.default_root_dir).expanduser() / "timeline" / f"rank-{trainer.global_rank}.csv"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.is_file():  # a resumed run appends to its earlier attempt's rows
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(TIMELINE_COLUMNS)
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        self._hooks.append(pl_module.register_forward_pre_hook(self._on_forward))
        self._prev_global_step = trainer.global_step
        self._reset_peak(device)
        self.clock.start()
        self.clock.begin("data")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # "data" runs on to the module's forward (host work in batch-start hooks counts as waiting,
        # as in the straggler report); the pipeline schedule calls its stages instead: start here.
        if self.clock is not None and self._pipeline:
            self.clock.end("data")
            self.clock.begin("pipeline")

    def _on_forward(self, module: Any, args: Any) -> None:
        if self.clock is not None and module.training and self.clock.is_open("data"):
            self.clock.end("data")
            self.clock.begin("forward")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.clock is not None and not self._pipeline:
            self.clock.end("data")  # a training_step that bypassed the module's forward (no hook)
            self.clock.end("forward")
            self.clock.begin("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.clock is not None:
            self.clock.end("backward")
            self.clock.end("pipeline")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.clock is not None:
            self.clock.end("pipeline")
            self.clock.begin("optimizer")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = self.clock
        if clock is None:
            return
        for name in ("forward", "backward", "pipeline", "optimizer"):
            clock.end(name)
        if trainer.global_step != self._prev_global_step:  # an optimizer step ended (not a micro-batch)
            self._prev_global_step = trainer.global_step
            clock.close_step(trainer.global_step)
            device = trainer.strategy.root_device
            self._memory[trainer.global_step] = self._peak(device)
            self._reset_peak(device)
            self._add(clock.ready())
            if is_logging_step(trainer, trainer.global_step) or len(self._pending) >= FLUSH_ROWS:
                self._flush()
        clock.begin("data")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.clock is not None:
            self.clock.end("data")
            self.clock.begin("validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.clock is not None and self.clock.is_open("validation"):
            self.clock.end("validation")
            self.clock.begin("data")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._finish()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._finish()
        module_contract(pl_module).phase_clock = None

    # ---- helpers --------------------------------------------------------------------------------
    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.clock is not None:
            self.clock.end("optimizer")

    def _finish(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.clock is not None:
            self.clock.close()
            self._add(self.clock.ready(flush=True))
            self.clock = None
        self._flush()

    @staticmethod
    def _reset_peak(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @staticmethod
    def _peak(device: torch.device) -> tuple[float, float]:
        if device.type == "cuda":  # the caching allocator's counters: host-side, no sync
            return torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        return rss, float("nan")

    def rows_since(self, seen: int) -> tuple[list[dict[str, Any]], int]:
        """The rows made after the first ``seen`` (at most the last RECENT_ROWS), and the new count."""
        new = min(self.rows_total - seen, len(self.rows))
        return (list(self.rows)[-new:] if new > 0 else []), self.rows_total

    def _add(self, steps: list[StepTimes]) -> None:
        """Rows of the steps whose times are ready: buffered for the CSV, the latest kept in memory."""
        for s in steps:
            mem, reserved = self._memory.pop(s.step, (float("nan"), float("nan")))
            row: dict[str, Any] = {"step": s.step, "wall_s": s.wall_s}
            row.update({f"{p}_s": s.phases.get(p, 0.0) for p in PHASES})
            row.update({"other_s": s.other_s, "peak_mem_mib": mem, "peak_reserved_mib": reserved})
            self.rows.append(row)
            self._pending.append(row)
            self.rows_total += 1

    def _flush(self) -> None:
        """Append the buffered rows to the CSV in one open (a logging step, a full buffer, the end)."""
        if not self._pending or self.path is None:
            return
        with open(self.path, "a", newline="") as f:
            writer = csv.writer(f)
            for row in self._pending:
                writer.writerow([row[c] if isinstance(row[c], int) else f"{row[c]:.6g}" for c in TIMELINE_COLUMNS])
        self._pending = []
