"""Periodic straggler report: which rank holds the others up, and by how much.

In synchronous training every rank's *wall* step time is the same: the collectives inside the
step (FSDP all-gathers, TP reductions, pipeline sends) make every rank wait for the slowest one,
so the time a straggler loses shows up as *waiting* on all the others. Per-rank wall step times
therefore cannot name the straggler; ``StragglerReport`` estimates each rank's own step time:

    own_s[r] = step_s[r] - (max_r' outside_s[r'] - outside_s[r])

``outside_s[r]`` is the time rank ``r`` spends per optimizer step *outside the model*: from the
end of one batch to the moment it enters the next forward (data loading, host work in hooks and
logging). Nothing in there synchronises ranks, and the rank with the longest ``outside_s`` arrives
last at the step's first collective, where every other rank waits ``max outside_s - outside_s[r]``
for it. ``own_s`` charges that wait back to the rank that caused it: the slowest rank's ``own_s``
is the job's step time, the median is what the step would take if that rank were typical.

What it cannot see: slowness *inside* forward/backward (a slow GPU or link) is absorbed at each
collective of the step and spreads over all ranks alike; finding it needs per-collective timings
(e.g. NCCL's flight recorder), not step-level hooks.

Every ``every_n_steps`` optimizer steps (at the first logging step from there, see
``trainer.log_every_n_steps``: the gather reads its result back to the host), all ranks all-gather (world group, strategy device: CUDA
for NCCL, CPU for gloo) numbers over the window -- mean ``step_s``, mean ``outside_s``,
number of steps, and with the :class:`~lit_titan.callbacks.Timeline` callback each phase's mean
seconds (so the warning says in which phase the slowest rank loses its time) -- and log, from every rank alike (the gathered values are identical):
``straggler/slowest_rank``, ``straggler/slowest_step_s``, ``straggler/median_step_s``,
``straggler/ratio_to_median`` (of ``own_s``). When the ratio exceeds ``warn_ratio``, rank 0 prints
one warning line. The report step is decided from ``global_step`` alone, so every rank calls the
collective at the same step (no deadlock); the gather's own time is excluded from the next window.
The first step of a fit and steps after a checkpoint save are not measured; validation is excluded.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lit_titan.callbacks.settings import StragglerConfig
from lit_titan.observe.log_cadence import forget_logged, is_logging_step
from lit_titan.observe.phases import PHASES
from lit_titan.settings import settings_of

__all__ = ["StragglerReport", "straggler_stats"]

log = logging.getLogger(__name__)


def straggler_stats(step_s: list[float], outside_s: list[float]) -> dict[str, float]:
    """Slowest rank, its own step time, the median own step time and their ratio, from per-rank means."""
    if not step_s or len(step_s) != len(outside_s):
        raise ValueError("straggler_stats needs one step_s and one outside_s per rank")
    late = max(outside_s)
    own = [s - (late - o) for s, o in zip(step_s, outside_s)]
    slowest = max(range(len(own)), key=lambda r: (own[r], -r))  # ties: the lowest rank
    median = statistics.median(own)
    ratio = own[slowest] / median if median > 0 else float("inf")
    return {
        "slowest_rank": float(slowest),
        "slowest_step_s": own[slowest],
        "median_step_s": median,
        "ratio_to_median": ratio,
    }


class StragglerReport(L.Callback):
    """Every N optimizer steps: gather per-rank step timings, log the slowest rank and its ratio to the median.

    Takes a ``StragglerConfig`` (``callbacks/settings.py``) or its fields by name:
        every_n_steps: report every N optimizer steps (all ranks gather at the same steps).
        warn_ratio: rank 0 prints a warning when ``ratio_to_median`` exceeds this.
    """

    def __init__(self, settings: StragglerConfig | None = None, **keys: Any) -> None:
        s = self.settings = settings_of(StragglerConfig, settings, keys)
        if s.every_n_steps < 1:
            raise ValueError("StragglerReport every_n_steps must be >= 1")
        self.every_n_steps = int(s.every_n_steps)
        self.warn_ratio = float(s.warn_ratio)
        self.last: dict[str, Any] = {}  # the latest report, with the per-rank lists
        self._hook: Any = None
        self._logged = False
        self._prev_global_step = 0
        self._t_prev_end: float | None = None  # end of the previous batch
        self._t_prev_step: float | None = None  # end of the previous optimizer step
        self._t_batch_start: float | None = None
        self._t_forward: float | None = None  # this batch entered the module's forward
        self._due = False  # every_n_steps reached; report at the next logging step
        self._timeline_seen = 0  # Timeline rows already summarised
        self._reset_window()

    # ---- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Entering the LightningModule's forward ends the "outside the model" time of a batch.
        # Under pipeline parallelism the schedule calls the stages instead; then the batch start does.
        if self._hook is None:
            self._hook = pl_module.register_forward_pre_hook(self._on_forward)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._due = False
        self._reset_window()
        self._restart_clock(None)
        self._prev_global_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._logged:
            forget_logged(trainer, "straggler/")
            self._logged = False
        self._t_batch_start, self._t_forward = time.perf_counter(), None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._t_prev_end is not None and self._t_batch_start is not None:
            self._outside += (self._t_forward or self._t_batch_start) - self._t_prev_end
        self._t_batch_start = None
        self._t_prev_end = now
        if trainer.global_step == self._prev_global_step:
            return  # inside a gradient-accumulation window
        self._prev_global_step = trainer.global_step
        if self._t_prev_step is not None and not self._discard:
            self._sum_step += now - self._t_prev_step
            self._sum_outside += self._outside
            self._n += 1
        self._outside, self._discard = 0.0, False
        self._t_prev_step = now
        if trainer.global_step % self.every_n_steps == 0:
            self._due = True
        # On the first logging step from there: a gather is a host sync (and only a logging step
        # writes the values). Both depend on global_step alone, so every rank gathers together.
        if self._due and is_logging_step(trainer, trainer.global_step):
            self._due = False
            self._report(trainer, pl_module)
            self._restart_clock(time.perf_counter())  # the gather is not part of any step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation runs between a step's end and the next step: measure that step from here.
        if not trainer.sanity_checking and self._t_prev_end is not None:
            self._restart_clock(time.perf_counter())

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._discard = True  # the save runs between this step's end and the next step's forward

    # ---- helpers --------------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any) -> None:
        if self._t_batch_start is not None and self._t_forward is None and module.training:
            self._t_forward = time.perf_counter()

    def _reset_window(self) -> None:
        self._sum_step, self._sum_outside, self._n = 0.0, 0.0, 0
        self._outside, self._discard = 0.0, False

    def _restart_clock(self, now: float | None) -> None:
        self._t_prev_end = self._t_prev_step = now
        self._t_batch_start = self._t_forward = None
        self._outside = 0.0

    def _timeline_phases(self, trainer: L.Trainer) -> list[float]:
        """Mean seconds per phase over the timeline rows written since the last report (zeros without one).

        With the Timeline callback (on by default) the report says *where* the slowest rank's time
        goes, not only that it is slow. On GPU its rows arrive a few steps late; they are as recent
        as the timeline has them.
        """
        from lit_titan.callbacks.timeline import Timeline

        timeline = next((cb for cb in trainer.callbacks if isinstance(cb, Timeline)), None)
        if timeline is None:
            return [0.0] * len(PHASES)
        rows, self._timeline_seen = timeline.rows_since(self._timeline_seen)
        if not rows:
            return [0.0] * len(PHASES)
        return [sum(r[f"{p}_s"] for r in rows) / len(rows) for p in PHASES]

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = self._n
        local = torch.tensor(
            [self._sum_step / max(n, 1), self._sum_outside / max(n, 1), float(n), *self._timeline_phases(trainer)],
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        self._reset_window()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)  # every rank, same step: decided by global_step only
        else:
            gathered = [local]
        rows = torch.stack(gathered).cpu().tolist()
        phases = [dict(zip(PHASES, r[3:])) for r in rows]
        rows = [r[:3] for r in rows]
        if any(count == 0 for _, _, count in rows):
            return  # a rank measured no step in this window (first window, validation, saves)
        step_s = [r[0] for r in rows]
        outside_s = [r[1] for r in rows]
        stats = straggler_stats(step_s, outside_s)
        self.last = {
            **stats,
            "global_step": trainer.global_step,
            "step_s": step_s,
            "outside_s": outside_s,
            "phases": phases,
        }
        for key, value in stats.items():
            pl_module.log(f"straggler/{key}", value, on_step=True, on_epoch=False)
        self._logged = True
        if trainer.is_global_zero and stats["ratio_to_median"] > self.warn_ratio:
            slowest = int(stats["slowest_rank"])
            log.warning(
                f"lit-titan straggler: rank {slowest} is the slowest over the last {int(rows[slowest][2])} steps "
                f"(to global_step {trainer.global_step}): {stats['slowest_step_s']:.3f} s/step vs median "
                f"{stats['median_step_s']:.3f} s ({stats['ratio_to_median']:.2f}x > warn_ratio {self.warn_ratio:g}); "
                f"it spends {outside_s[slowest]:.3f} s/step outside the model (data loading, host work) vs "
                f"{statistics.median(outside_s):.3f} s median{_phase_excess(phases, slowest)}"
            )


def _phase_excess(phases: list[dict[str, float]], rank: int) -> str:
    """ "; timeline: most over the median in <phase> (+X s/step)" for ``rank``, or "" without a timeline."""
    if not any(any(p.values()) for p in phases):
        return ""
    excess = {name: phases[rank][name] - statistics.median(p[name] for p in phases) for name in PHASES}
    name = max(excess, key=excess.get)
    return (
        f"; timeline: its phase furthest over the median is {name} (+{excess[name]:.3f} s/step, "
        f"{phases[rank][name]:.3f} vs {statistics.median(p[name] for p in phases):.3f} s)"
    )
