"""The report's figures: each one its data (``series``) and an SVG drawn from exactly that data.

A figure keeps its series next to its picture so the report can embed both (tests and scripts
read the numbers back; people look at the SVG), and every plotted artist carries the series name
as its SVG ``id`` (matplotlib's ``gid``).
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lit_titan.observe.phases import PHASES
from lit_titan.report.runs import Run

__all__ = ["Figure", "build_figures"]


@dataclass
class Figure:
    """One plot: ``kind`` is ``lines`` (series: label -> {x, y}), ``heatmap`` (series: {x, y, z}) or ``bars``."""

    id: str
    title: str
    xlabel: str
    ylabel: str
    kind: str = "lines"
    series: dict[str, Any] = field(default_factory=dict)
    svg: str = ""

    @property
    def empty(self) -> bool:
        return not self.series


def _lines(fig: Figure, runs: list[Run], key: str, label: str | None = None) -> None:
    for run in runs:
        points = run.series(key)
        if points:
            name = (label or key) if len(runs) == 1 else f"{run.name}: {label or key}"
            fig.series[name] = {"x": [p[0] for p in points], "y": [p[1] for p in points]}


def _per_rank(fig: Figure, run: Run, value: Callable[[dict[str, float]], float | None]) -> None:
    """One series per rank: ``value(row)`` per timeline row, rows where it is None left out."""
    for rank, rows in sorted(run.timeline.items()):
        points = [(int(row["step"]), v) for row in rows if (v := value(row)) is not None]
        if points:
            fig.series[f"rank {rank}"] = {"x": [p[0] for p in points], "y": [p[1] for p in points]}


# (id, title, y label, metrics.csv keys): curves of every run, overlaid for a sweep
METRIC_FIGURES = (
    ("loss", "Loss", "loss", ("train/loss", "val/loss")),
    ("lr", "Learning rate", "lr", ("train/lr",)),
    ("grad_norm", "Gradient norm (before clipping)", "global L2 norm", ("train/grad_norm",)),
    ("tokens_per_s", "Throughput", "tokens/s per device", ("perf/tokens_per_sec_per_device",)),
    ("mfu", "Model FLOPs utilisation", "MFU", ("perf/mfu",)),
    ("aux_loss", "MoE auxiliary (load-balancing) loss", "loss", ("train/aux_loss",)),
    # optim=muon (optim/muon.py): Moonlight's scaling puts the hidden matrices' near AdamW's ~0.2
    (
        "update_rms",
        "Update RMS per layer group (Muon)",
        "RMS of the update / lr",
        tuple(f"optim/update_rms/{g}" for g in ("hidden", "embedding_head", "norms")),
    ),
)


def _expert_load(runs: list[Run]) -> Figure:
    """MoE runs: max/mean tokens per expert of each layer over the steps (observe/expert_load.py's keys)."""
    from lit_titan.observe.expert_load import PREFIX

    fig = Figure(
        "expert_load", "MoE expert load per layer (1 = balanced)", "optimizer step", "max/mean tokens per expert"
    )
    for run in runs:
        keys = sorted((k for k in run.metrics if k.startswith(PREFIX)), key=lambda k: int(k.rsplit("layer", 1)[1]))
        for key in keys:
            points, label = run.series(key), key[len(PREFIX) :]
            name = label if len(runs) == 1 else f"{run.name}: {label}"
            fig.series[name] = {"x": [p[0] for p in points], "y": [p[1] for p in points]}
    return fig


def build_figures(runs: list[Run]) -> list[Figure]:
    """Every figure the report shows, in order; for a sweep, metric curves of all runs overlaid."""
    figs = []
    for fig_id, title, ylabel, keys in METRIC_FIGURES:
        fig = Figure(fig_id, title, "optimizer step", ylabel)
        for key in keys:
            _lines(fig, runs, key)
        figs.append(fig)
    figs.append(_expert_load(runs))
    if len(runs) == 1 and runs[0].timeline:
        figs.extend(_timeline_figures(runs[0]))
    if len(runs) == 1 and runs[0].faults:
        figs.append(_faults_figure(runs[0]))
    for fig in figs:
        if not fig.empty:
            fig.svg = render(fig)
    return [f for f in figs if not f.empty]


def _timeline_figures(run: Run) -> list[Figure]:
    ranks = sorted(run.timeline)
    steps = sorted({int(r["step"]) for rows in run.timeline.values() for r in rows})
    heat = Figure(
        "step_time_heatmap",
        "Step wall time per rank (a straggler is a bright row)",
        "optimizer step",
        "rank",
        kind="heatmap",
    )
    by = {rank: {int(r["step"]): r.get("wall_s") for r in rows} for rank, rows in run.timeline.items()}
    heat.series = {"x": steps, "y": ranks, "z": [[by[rank].get(s) for s in steps] for rank in ranks]}
    phases = Figure("phases", "Where a step's time goes (mean per step)", "rank", "seconds", kind="bars")
    for name in (*PHASES, "other"):
        means = [statistics.fmean(r.get(f"{name}_s", 0.0) for r in run.timeline[rank]) for rank in ranks]
        if any(means):
            phases.series[name] = {"x": ranks, "y": means}
    data = Figure("data_wait", "Data wait fraction", "optimizer step", "data_s / wall_s")
    _per_rank(data, run, lambda r: r["data_s"] / r["wall_s"] if "data_s" in r and r.get("wall_s") else None)
    memory = Figure("memory", "Peak memory per rank", "optimizer step", "MiB (CUDA allocated, or CPU peak RSS)")
    _per_rank(memory, run, lambda r: r.get("peak_mem_mib"))
    ckpt = Figure("checkpoint", "Training blocked by checkpoint saves", "optimizer step (after the save)", "seconds")
    _per_rank(ckpt, run, lambda r: r["checkpoint_s"] if r.get("checkpoint_s", 0) > 0 else None)
    return [heat, phases, data, memory, ckpt]


def _faults_figure(run: Run) -> Figure:
    """Replica groups training over the steps: a step down where one left, up where it rejoined."""
    fig = Figure("faults", "Replica groups training (membership.csv: who left or joined)", "optimizer step", "groups")
    steps, groups = [], []
    for row in run.faults:
        before = len(row["members"].split()) + (len(row["replicas"].split()) * (1 if row["event"] == "left" else -1))
        steps += [int(row["step"]), int(row["step"])]
        groups += [before, len(row["members"].split())]
    last = max((p[0] for points in run.metrics.values() for p in points), default=steps[-1])
    fig.series["replica groups"] = {"x": steps + [max(last, steps[-1])], "y": groups + [groups[-1]]}
    return fig


def render(fig: Figure) -> str:
    """The figure as an inline SVG (no fonts or images fetched: the report opens offline)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    f, ax = plt.subplots(figsize=(6.4, 3.4), layout="constrained")
    try:
        if fig.kind == "heatmap":
            z = [[float("nan") if v is None else v for v in row] for row in fig.series["z"]]
            x, y = fig.series["x"], fig.series["y"]
            image = ax.imshow(
                z,
                aspect="auto",
                interpolation="nearest",
                cmap="viridis",
                extent=(x[0] - 0.5, x[-1] + 0.5, len(y) - 0.5, -0.5),
            )
            image.set_gid("series:wall_s")
            ax.set_yticks(range(len(y)), [str(r) for r in y])
            f.colorbar(image, ax=ax, label="s")
        elif fig.kind == "bars":
            bottom = None
            for name, s in fig.series.items():
                bars = ax.bar([str(r) for r in s["x"]], s["y"], bottom=bottom, label=name)
                for i, patch in enumerate(bars):
                    patch.set_gid(f"series:{name}:{i}")
                bottom = s["y"] if bottom is None else [a + b for a, b in zip(bottom, s["y"])]
            ax.legend(fontsize=7, ncols=2)
        else:
            for name, s in fig.series.items():
                (line,) = ax.plot(s["x"], s["y"], label=name, marker="." if len(s["x"]) < 30 else None)
                line.set_gid(f"series:{name}")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        ax.set_title(fig.title, fontsize=10)
        ax.set_xlabel(fig.xlabel)
        ax.set_ylabel(fig.ylabel)
        buf = io.StringIO()
        f.savefig(buf, format="svg")
    finally:
        plt.close(f)
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]  # drop the XML prolog and DOCTYPE: inline in HTML
