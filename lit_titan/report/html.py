"""``report.html``: one self-contained page (inline SVG, no scripts or fetched assets) per run or sweep."""

from __future__ import annotations

import html
import json
import os
import shlex
import time
from pathlib import Path

from lit_titan.report.figures import Figure
from lit_titan.report.runs import Run

__all__ = ["write_report"]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.5em}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(640px,1fr));gap:1em}
figure{margin:0;border:1px solid #ddd;border-radius:6px;padding:.4em;background:#fff}
figure svg{width:100%;height:auto}
pre{background:#f6f6f6;padding:.8em;max-height:28em;overflow:auto;font-size:.8em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:.2em .6em;text-align:right}
.muted{color:#777}
"""


def write_report(root: Path, runs: list[Run], figures: list[Figure]) -> Path:
    """Write ``root/report.html`` and return its path."""
    out = root / "report.html"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>lit-titan report: {html.escape(root.name)}"
        f"</title><style>{_STYLE}</style></head><body>",
        f"<h1>lit-titan report: {html.escape(str(root))}</h1>",
        f"<p class='muted'>written {time.strftime('%Y-%m-%d %H:%M:%S')} from {len(runs)} run(s); "
        "steps are optimizer steps from 1. Re-run "
        f"<code>{html.escape(shlex.join(['lit-titan', 'report', str(root)]))}</code> "
        f"to refresh a run in progress.</p>",
        _summary(runs),
        "<h2>Figures</h2><div class='grid'>",
    ]
    for fig in figures:
        data = html.escape(json.dumps({"kind": fig.kind, "series": fig.series}), quote=True)
        parts.append(
            f"<figure id='fig-{fig.id}' data-series=\"{data}\">{fig.svg}"
            f"<figcaption class='muted'>{html.escape(fig.title)}</figcaption></figure>"
        )
    parts.append("</div>")
    for run in runs:
        parts.append(_run_details(root, run, len(runs) > 1))
    parts.append("</body></html>")
    out.write_text("\n".join(parts))
    return out


def _summary(runs: list[Run]) -> str:
    rows = [
        "<table><tr><th>run</th><th>steps</th><th>final train/loss</th><th>min val/loss</th>"
        "<th>ranks in timeline</th><th>median step s</th><th>checkpoints</th></tr>"
    ]
    for run in runs:
        loss = run.series("train/loss")
        val = run.series("val/loss")
        walls = sorted(r["wall_s"] for rows in run.timeline.values() for r in rows if "wall_s" in r)
        median = f"{walls[len(walls) // 2]:.3f}" if walls else "-"
        rows.append(
            f"<tr><td style='text-align:left'>{html.escape(run.name)}</td><td>{loss[-1][0] if loss else '-'}"
            f"</td><td>{f'{loss[-1][1]:.4f}' if loss else '-'}</td>"
            f"<td>{f'{min(v for _, v in val):.4f}' if val else '-'}</td><td>{len(run.timeline)}</td>"
            f"<td>{median}</td><td>{len(run.checkpoints)}</td></tr>"
        )
    return "\n".join(rows) + "</table>"


def _figures(run: Run) -> str:
    """Parameters, layout, wall time and tokens (summary.json, written when the run ends)."""
    s = run.summary
    if not s:
        return (
            "<p class='muted'>No summary.json yet (written when the run ends): parameters, layout, wall time "
            "and tokens appear then.</p>"
        )
    layout = s.get("layout") or {}
    cells = [
        ("parameters", f"{s['parameters']:,}" if isinstance(s.get("parameters"), int) else "-"),
        (
            "layout",
            " x ".join(f"{k} {v}" for k, v in layout.items()) + f" ({s.get('world_size', '?')} ranks)"
            if layout
            else "-",
        ),
        ("steps", str(s.get("steps", "-"))),
        ("tokens", f"{s['tokens']:,}" if isinstance(s.get("tokens"), int) else "-"),
        ("wall time (training steps)", f"{s['train_seconds']} s" if s.get("train_seconds") is not None else "-"),
        ("tokens/s", str(s.get("tokens_per_second") or "-")),
    ]
    return (
        "<table id='run-figures'>"
        + "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in cells
        )
        + "</table>"
    )


def _link(root: Path, path: Path) -> str:
    rel = os.path.relpath(path, root)
    return f"<a href='{html.escape(rel)}'>{html.escape(rel)}</a>"


def _preflight(root: Path, run: Run) -> str:
    """Pre-flight verdict and per-rank figures (preflight.json, lit_titan/observe/diagnostics.py)."""
    pf = run.preflight or {}
    found = pf.get("found") or []
    verdict = ("<b>found</b>: " + html.escape("; ".join(found))) if found else "nothing below the threshold"
    rows = "".join(
        f"<tr><td>{r.get('rank')}</td><td>{r.get('node', '-')}</td><td>{html.escape(str(r.get('host')))}</td>"
        f"<td>{r.get('tflops', 0):.4g}</td><td>"
        + html.escape(
            ", ".join(
                f"{d} {v.get('ranks', '')} {v.get('all_reduce_gbps', 0):.3g}/{v.get('all_gather_gbps', 0):.3g}"
                for d, v in (r.get("links") or {}).items()
            )
        )
        + "</td></tr>"
        for r in pf.get("ranks") or []
    )
    return (
        f"<p><b>Pre-flight</b> ({_link(root, run.path / 'preflight.json')}, threshold {pf.get('threshold')} x "
        f"median, action {html.escape(str(pf.get('action')))}): {verdict}</p><details><summary>Per rank: matmul "
        f"TFLOP/s, all-reduce/all-gather GB/s per mesh group and intra-/inter-node group (its ranks)</summary>"
        f"<table><tr><th>rank</th><th>node</th><th>host</th>"
        f"<th>TFLOP/s</th><th>links</th></tr>{rows}</table></details>"
    )


def _run_details(root: Path, run: Run, sweep: bool) -> str:
    parts = [f"<h2>{'Run ' + html.escape(run.name) if sweep else 'Run'}: configuration and files</h2>"]
    if run.traces:
        parts.append(
            "<p>Profiler traces (open in <code>chrome://tracing</code> or ui.perfetto.dev): "
            + ", ".join(_link(root, p) for p in run.traces)
            + "</p>"
        )
    if run.memory_snapshots:
        parts.append(
            "<p>Memory snapshots (pytorch.org/memory_viz): "
            + ", ".join(_link(root, p) for p in run.memory_snapshots)
            + "</p>"
        )
    if run.hang_files:
        parts.append("<p><b>Hang dumps</b> (watchdog): " + ", ".join(_link(root, p) for p in run.hang_files) + "</p>")
    if run.preflight:
        parts.append(_preflight(root, run))
    parts.append(_figures(run))
    if run.checkpoints:
        parts.append(f"<p>Checkpoints: {html.escape(', '.join(run.checkpoints))}</p>")
    parts.append(
        f"<details{'' if sweep else ' open'}><summary>Resolved config (config.yaml: model with the "
        f"flavor's values, layout, data, optimizer)</summary><pre>{html.escape(run.config)}</pre></details>"
    )
    return "\n".join(parts)
