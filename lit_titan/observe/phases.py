"""Named phases of an optimizer step: timed without host syncs, and visible to ``torch.profiler``.

Each phase is a ``torch.profiler.record_function`` range (``lit_titan/<phase>``: free unless a
profiler is recording) and, while a :class:`PhaseClock` is attached, a pair of time marks. On CUDA
the marks are CUDA events recorded on the current stream and read only once the GPU has passed
them (``Event.query``, which does not block), so a step's times arrive a few steps late and the
CPU never waits for the GPU; on CPU they are ``time.perf_counter`` readings.

Phases are begun and ended from Lightning hooks (:class:`~lit_titan.callbacks.Timeline`) and from
the code that owns the work (gradient clipping in the module, checkpoint staging in the strategy),
which reach the clock through :func:`phase`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PHASES", "PhaseClock", "StepTimes", "phase"]

# Column order of the timeline; "pipeline" replaces forward/backward under pipeline parallelism
# (the schedule interleaves them), "grad_clip" is the global grad norm plus clipping, "validation" a
# validation run between two steps.
PHASES = ("data", "forward", "backward", "pipeline", "grad_clip", "optimizer", "checkpoint", "validation")


@dataclass
class StepTimes:
    """Seconds per phase of one optimizer step (``step`` counts from 1), and its wall time."""

    step: int
    wall_s: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        """Wall time in no named phase (Lightning's loop, hooks, logging)."""
        return self.wall_s - sum(self.phases.values())


class PhaseClock:
    """Per-step phase times of this process; see the module docstring.

    ``optimizer`` contains ``grad_clip`` and ``data`` contains ``checkpoint`` (they nest in time);
    :meth:`ready` reports them exclusive, so the phases of a step add up to its wall time.
    """

    NESTED = {"grad_clip": "optimizer", "checkpoint": "data"}

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self._open: dict[str, tuple[Any, Any]] = {}
        self._spans: list[tuple[str, Any, Any]] = []
        self._step_start: Any = None
        self._pending: deque[tuple[int, Any, Any, list[tuple[str, Any, Any]]]] = deque()

    # ---- marks ----------------------------------------------------------------------------------
    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def _passed(self, mark: Any) -> bool:
        return mark.query() if self.cuda else True

    # ---- phases ---------------------------------------------------------------------------------
    def begin(self, name: str) -> None:
        """Open ``name`` (a no-op if it is open already)."""
        if name in self._open:
            return
        rf = torch.profiler.record_function(f"lit_titan/{name}")
        rf.__enter__()
        self._open[name] = (self._mark(), rf)

    def end(self, name: str) -> None:
        """Close ``name`` if it is open; its time counts towards the current step."""
        opened = self._open.pop(name, None)
        if opened is None:
            return
        start, rf = opened
        rf.__exit__(None, None, None)
        self._spans.append((name, start, self._mark()))

    def is_open(self, name: str) -> bool:
        return name in self._open

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    # ---- steps ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first step's wall clock (training starts)."""
        self._step_start = self._mark()
        self._spans = []

    def close_step(self, step: int) -> None:
        """End optimizer step ``step``: its spans so far and its wall time wait in a queue for :meth:`ready`."""
        end = self._mark()
        if self._step_start is not None:
            self._pending.append((step, self._step_start, end, self._spans))
        self._spans, self._step_start = [], end

    def ready(self, flush: bool = False) -> list[StepTimes]:
        """Steps whose marks the device has passed (all, after a synchronize, with ``flush``)."""
        if flush and self.cuda and self._pending:
            torch.cuda.synchronize()
        out = []
        while self._pending and (flush or self._passed(self._pending[0][2])):
            step, start, end, spans = self._pending.popleft()
            phases: dict[str, float] = {}
            for name, a, b in spans:
                phases[name] = phases.get(name, 0.0) + self._seconds(a, b)
            for inner, outer in self.NESTED.items():
                if inner in phases and outer in phases:
                    phases[outer] = max(0.0, phases[outer] - phases[inner])
            out.append(StepTimes(step=step, wall_s=self._seconds(start, end), phases=phases))
        return out

    def close(self) -> None:
        """Exit every open profiler range (end of training or an exception)."""
        for name in list(self._open):
            self.end(name)


def phase(clock: PhaseClock | None, name: str) -> AbstractContextManager[None]:
    """``clock.span(name)`` when a clock is attached, else just the profiler range.

    ``clock`` is the module's ``phase_clock`` (the :class:`~lit_titan.callbacks.Timeline` attaches it
    while training); code that does not know whether a timeline runs calls this.
    """
    return clock.span(name) if clock is not None else torch.profiler.record_function(f"lit_titan/{name}")
