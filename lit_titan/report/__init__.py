"""``lit-titan report RUN_DIR``: a self-contained HTML page of a run (or a sweep) to look at.

Loss, learning rate and gradient norm; tokens/s and MFU; a per-rank x per-step heatmap of step
time; where each step's time goes; data wait; memory; checkpoint stalls; the resolved config and
links to the profiler traces. Reads only what the run wrote, so it works while the run goes on.
"""

from __future__ import annotations

from pathlib import Path

from lit_titan.report.figures import Figure, build_figures
from lit_titan.report.html import write_report
from lit_titan.report.runs import Run, find_runs, load_run

__all__ = ["Figure", "Run", "build_figures", "find_runs", "load_run", "make_report", "write_report"]


def make_report(path: str | Path) -> Path:
    """Write ``<path>/report.html`` for a run or sweep directory; returns its path."""
    root = Path(path).expanduser().resolve()
    runs = [load_run(p) for p in find_runs(root)]
    return write_report(root, runs, build_figures(runs))
