"""What a run directory holds, read for the report: metrics, per-rank timelines, config, traces.

Works on a run still in progress (rows written so far) and on a sweep directory (every
sub-directory that is a run). Steps are optimizer steps counted from 1: Lightning's
``metrics.csv`` counts from 0, the timeline from 1.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from lit_titan.errors import ConfigError

__all__ = ["Run", "find_runs", "load_run"]


@dataclass
class Run:
    """One run directory, as read now."""

    path: Path
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # key -> (step, value)
    timeline: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # rank -> rows by step
    config: str = ""
    traces: list[Path] = field(default_factory=list)
    memory_snapshots: list[Path] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    hang_files: list[Path] = field(default_factory=list)
    preflight: dict | None = None  # preflight.json (lit_titan/observe/diagnostics.py), when the run had one
    summary: dict | None = None  # summary.json (lit_titan/callbacks/run_summary.py), once the run has ended
    faults: list[dict[str, str]] = field(default_factory=list)  # membership.csv (lit_titan/fault_tolerance/events.py)

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str) -> list[tuple[int, float]]:
        return self.metrics.get(key, [])


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() and ((path / "metrics.csv").is_file() or (path / "timeline").is_dir())


def find_runs(path: Path) -> list[Path]:
    """``[path]`` for a run directory, its runs for a sweep directory; one-line error otherwise."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"lit-titan report: {path} is not a directory; pass a run directory (the run_dir= of "
            f"a training job, holding config.yaml and metrics.csv) or a sweep directory"
        )
    if is_run(path):
        return [path]
    # a sweep's runs are its sub-directories (Hydra: <sweep>/<n>/), or one level further down
    found = [*path.glob("*/config.yaml"), *path.glob("*/*/config.yaml")]
    runs = sorted((p for p in found if is_run(p.parent)), key=_natural)
    if not runs:
        raise ConfigError(
            f"lit-titan report: {path} is not a run directory (no config.yaml with metrics.csv or "
            f"timeline/) and holds none; pass the run_dir= of a training job or a sweep directory"
        )
    return [p.parent for p in runs]


def _natural(path: Path) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in path.parent.parts)


def load_run(path: Path) -> Run:
    run = Run(path=Path(path))
    metrics = sorted(run.path.glob("metrics.attempt-*.csv")) + [run.path / "metrics.csv"]
    for file in metrics:  # earlier attempts first: a resumed run's rows replace theirs
        for row in _rows(file):
            step = _int(row.get("step"))
            if step is None:
                continue
            for key, value in row.items():
                number = _float(value)
                if key in ("step", "epoch") or number is None:
                    continue
                points = run.metrics.setdefault(key, [])
                points[:] = [p for p in points if p[0] != step + 1]
                points.append((step + 1, number))
    for points in run.metrics.values():
        points.sort()
    for file in sorted((run.path / "timeline").glob("rank-*.csv")):
        rank = _int(file.stem.split("-")[-1])
        if rank is None:
            continue
        by_step: dict[int, dict[str, float]] = {}
        for row in _rows(file):
            parsed = {k: _float(v) for k, v in row.items()}
            if parsed.get("step") is not None:
                by_step[int(parsed["step"])] = {k: v for k, v in parsed.items() if v is not None}
        run.timeline[rank] = [by_step[s] for s in sorted(by_step)]
    if (run.path / "config.yaml").is_file():
        run.config = _redacted_config(run.path / "config.yaml")
    run.traces = sorted((run.path / "profile").glob("step-*/rank-*.json.gz"))
    run.memory_snapshots = sorted(run.path.glob("profile/step-*/rank-*.memory.pickle")) + sorted(
        run.path.glob("memory/oom-rank-*.pickle")
    )
    run.checkpoints = sorted(p.name for p in (run.path / "checkpoints").glob("step-*") if p.is_dir())
    run.hang_files = sorted((run.path / "hang").glob("*")) if (run.path / "hang").is_dir() else []
    run.preflight = _json(run.path / "preflight.json")
    run.summary = _json(run.path / "summary.json")
    run.faults = _rows(run.path / "membership.csv")
    return run


def _json(file: Path) -> dict | None:
    import json

    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):  # absent (a run in progress) or cut short
        return None
    return data if isinstance(data, dict) else None


def _rows(file: Path) -> list[dict[str, str]]:
    if not file.is_file():
        return []
    with open(file, newline="") as f:
        return list(csv.DictReader(f))


def _float(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return None if math.isnan(number) else number


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "") else None
    except ValueError:
        return None


def _redacted_config(path: Path) -> str:
    """config.yaml for the page people share, credentials as ``***`` (a run written before redaction too)."""
    import yaml

    from lit_titan.observe.redact import redact

    text = path.read_text()
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    redacted = redact(loaded)
    return text if redacted == loaded else yaml.safe_dump(redacted, sort_keys=False)
