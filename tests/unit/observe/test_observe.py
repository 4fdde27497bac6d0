"""Profiler traces, the per-rank timeline, the run report (the hang dumps: test_fault_callbacks.py)."""

from __future__ import annotations

import csv
import gzip
import html
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TINY, read_metrics, run_job
from lit_titan.callbacks.profiler import profile_windows
from lit_titan.callbacks.timeline import TIMELINE_COLUMNS
from lit_titan.errors import ConfigError
from lit_titan.observe.phases import PHASES, PhaseClock

TWO_RANKS = [
    *TINY,
    "cluster.devices=2",
    "parallel.dp_shard=2",
    "seed=0",
    "trainer.max_steps=6",
    "callbacks=[throughput,timeline,profiler]",
    "callbacks.profiler.steps=[3,4]",
    "checkpoint.every_n_steps=4",
    "trainer.limit_val_batches=0",
]
NAMED = {"lit_titan/data", "lit_titan/forward", "lit_titan/backward", "lit_titan/grad_clip", "lit_titan/optimizer"}


# ---- units ---------------------------------------------------------------------------------------
def test_phase_clock_reports_exclusive_phases_that_add_up_to_the_step():
    clock = PhaseClock()
    clock.start()
    # The test's own readings bracket each outer phase: an exclusive inner phase plus its outer one fit
    # inside the bracket; counted twice they would exceed it by the inner sleep. No bound on how long a
    # sleep took (a loaded machine oversleeps), only lower bounds and this ratio-free containment.
    t0 = time.perf_counter()
    clock.begin("data")
    time.sleep(0.02)
    with clock.span("checkpoint"):  # nested in data
        time.sleep(0.03)
    clock.end("data")
    data_bracket = time.perf_counter() - t0
    with clock.span("forward"):
        time.sleep(0.01)
    t0 = time.perf_counter()
    clock.begin("optimizer")
    with clock.span("grad_clip"):  # nested in optimizer
        time.sleep(0.02)
    time.sleep(0.01)
    clock.end("optimizer")
    optimizer_bracket = time.perf_counter() - t0
    clock.close_step(1)
    (step,) = clock.ready()
    p = step.phases
    assert step.step == 1 and p["data"] >= 0.02 and p["checkpoint"] >= 0.03
    assert p["data"] + p["checkpoint"] <= data_bracket
    assert p["grad_clip"] >= 0.02 and p["optimizer"] >= 0.01 and p["forward"] >= 0.01
    assert p["optimizer"] + p["grad_clip"] <= optimizer_bracket
    assert step.other_s >= 0 and abs(sum(p.values()) + step.other_s - step.wall_s) < 1e-9
    assert clock.ready() == []  # each step once


def test_profile_windows_and_their_bad_settings():
    assert profile_windows(10, [3, 4], None, 2) == [(3, 4)]
    assert profile_windows(10, None, 4, 2) == [(4, 5), (8, 9)]
    for steps, every, message in (
        ([8, 12], None, "trainer.max_steps=10"),
        ([4, 3], None, "1 <= FIRST <= LAST"),
        ([3, 4], 5, "not both"),
        (None, 20, "every_n_steps=20"),
        (None, None, "needs"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            profile_windows(10, steps, every, 2)


@pytest.mark.slow  # a command line: its imports take 10-20 s on 2 busy cores
def test_a_profile_window_outside_the_run_is_one_line_before_anything_starts(tmp_path):
    proc = run_job(
        [
            sys.executable,
            "-m",
            "lit_titan.train",
            *TINY,
            "trainer.max_steps=5",
            "callbacks=[profiler]",
            "callbacks.profiler.steps=[4,9]",
            f"run_dir={tmp_path / 'r'}",
        ],
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "lit-titan: error: callbacks.profiler.steps=[4, 9]: ends after the run's last step (trainer.max_steps=5); "
        "choose steps within 1..5"
    )
    assert not (tmp_path / "r").exists()


def test_report_refuses_what_is_not_a_run(tmp_path):
    from lit_titan.report import make_report

    with pytest.raises(ConfigError, match="is not a directory"):
        make_report(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a run directory"):
        make_report(tmp_path)


@pytest.mark.slow  # a command line: its imports take 10-20 s on 2 busy cores
def test_report_command_prints_one_line_for_what_is_not_a_run(tmp_path):
    proc = run_job([sys.executable, "-m", "lit_titan.cli", "report", str(tmp_path)], timeout=180)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "run_dir=" in proc.stderr


# ---- one 2-process run, checked three ways --------------------------------------------------------
@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, worlds):
    run_dir = tmp_path_factory.mktemp("observed")
    worlds.train(TWO_RANKS, run_dir)
    return run_dir


def _figures(page: str) -> dict[str, dict]:
    found = re.findall(r"<figure id='fig-([a-z_]+)' data-series=\"([^\"]*)\">", page)
    return {name: json.loads(html.unescape(data)) for name, data in found}


def _timeline(run_dir: Path, rank: int) -> list[dict[str, float]]:
    with open(run_dir / "timeline" / f"rank-{rank}.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == TIMELINE_COLUMNS
        return [{k: float(v) for k, v in row.items()} for row in reader]


@pytest.mark.slow
def test_profiler_leaves_gzip_chrome_traces_with_our_phases_on_every_rank(observed_run):
    for rank in (0, 1):
        path = observed_run / "profile" / "step-000003" / f"rank-{rank}.json.gz"
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert NAMED <= names, NAMED - names
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
        assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names)  # the model ran in it
    assert sorted(p.name for p in (observed_run / "profile").glob("*")) == ["step-000003"]  # that window only


@pytest.mark.slow
def test_timeline_has_one_row_per_step_per_rank_and_its_phases_add_up(observed_run):
    for rank in (0, 1):
        rows = _timeline(observed_run, rank)
        assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
        for r in rows:
            phases = sum(r[f"{p}_s"] for p in PHASES)
            assert min(r[f"{p}_s"] for p in PHASES) >= 0 and r["other_s"] >= -1e-6, r
            assert phases + r["other_s"] == pytest.approx(r["wall_s"], rel=1e-4, abs=1e-5)
            assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0 and r["grad_clip_s"] > 0
            assert r["peak_mem_mib"] > 50  # the CPU peak RSS of a process that imported torch
        # the save after step 4 blocks the loop before step 5's first batch: it shows in row 5 only
        assert rows[4]["checkpoint_s"] > 0 and all(r["checkpoint_s"] == 0 for i, r in enumerate(rows) if i != 4)


@pytest.mark.slow
def test_report_plots_the_runs_own_numbers(observed_run, tmp_path):
    from lit_titan.report import make_report

    page = make_report(observed_run).read_text()
    figs = _figures(page)
    assert {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_heatmap",
        "phases",
        "data_wait",
        "memory",
        "checkpoint",
    } <= set(figs), sorted(figs)
    metrics = [r for r in read_metrics(observed_run) if r.get("train/loss")]
    loss = figs["loss"]["series"]["train/loss"]
    assert loss["x"] == [int(r["step"]) + 1 for r in metrics]
    assert loss["y"] == pytest.approx([float(r["train/loss"]) for r in metrics], rel=1e-7)
    timelines = {rank: _timeline(observed_run, rank) for rank in (0, 1)}
    heat = figs["step_time_heatmap"]["series"]
    assert heat["y"] == [0, 1] and heat["x"] == [1, 2, 3, 4, 5, 6]
    for rank in (0, 1):
        assert heat["z"][rank] == pytest.approx([r["wall_s"] for r in timelines[rank]], rel=1e-6)
        assert figs["memory"]["series"][f"rank {rank}"]["y"] == pytest.approx(
            [r["peak_mem_mib"] for r in timelines[rank]], rel=1e-6
        )
        assert figs["checkpoint"]["series"][f"rank {rank}"]["x"] == [5]
    phases = figs["phases"]["series"]
    assert phases["backward"]["x"] == [0, 1]
    assert phases["backward"]["y"][1] == pytest.approx(sum(r["backward_s"] for r in timelines[1]) / 6, rel=1e-6)
    # every figure is drawn: its series names are SVG ids in the page, nothing is fetched from outside
    assert 'id="series:train/loss"' in page and 'id="series:rank 1"' in page and 'id="series:wall_s"' in page
    assert not re.search(r"(src|href)=['\"]https?://", page)
    assert "profile/step-000003/rank-1.json.gz" in page and "dp_shard: 2" in page
    # the run's figures (summary.json) and the model's shape from its flavor, not only its name
    from lit_titan.config import compose
    from lit_titan.config.spec import model_args
    from lit_titan.models.registry import count_params

    args = model_args(compose(TWO_RANKS))
    figures = re.search(r"<table id='run-figures'>(.*?)</table>", page).group(1)
    assert f"<th style='text-align:left'>parameters</th><td>{count_params(args):,}</td>" in figures
    assert "<td>pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1 (2 ranks)</td>" in figures
    assert f"<th style='text-align:left'>tokens</th><td>{6 * 8 * 32:,}</td>" in figures  # steps x batch x seq_len
    assert re.search(r"wall time \(training steps\)</th><td>\d+(\.\d+)? s</td>", figures), figures
    assert f"rope_theta: {args.rope_theta}" in page and f"multiple_of: {args.multiple_of}" in page

    # a sweep: two runs side by side (one of them still in progress: its metrics cut short) overlay
    sweep = tmp_path / "sweep"
    for point in ("0", "1"):
        shutil.copytree(observed_run, sweep / point, ignore=shutil.ignore_patterns("report.html", "checkpoints"))
    lines = (sweep / "1" / "metrics.csv").read_text().splitlines()
    (sweep / "1" / "metrics.csv").write_text("\n".join(lines[:3]) + "\n")
    sweep_figs = _figures(make_report(sweep).read_text())
    series = sweep_figs["loss"]["series"]
    assert len(series["0: train/loss"]["x"]) == len(loss["x"]) and len(series["1: train/loss"]["x"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_report_renders_in_headless_chromium(observed_run, tmp_path):
    from lit_titan.report import make_report

    page = make_report(observed_run)
    shot = tmp_path / "report.png"
    cmd = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,2400",
        f"--screenshot={shot}",
        page.as_uri(),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    dom = subprocess.run(
        [*cmd[:5], "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    assert dom.count("<svg") >= 9 and "series:train/loss" in dom
    assert shot.stat().st_size > 50_000  # a page of plots, not a blank one


# ---- the CUDA side (runs where a GPU is; skipped on CPU) ---------------------------------------------
@pytest.mark.gpu
def test_cuda_timeline_events_and_memory_snapshot(tmp_path):
    """One GPU: CUDA-event phases, the allocator's peaks, and the window's memory snapshot."""
    run_dir = tmp_path / "gpu"
    proc = run_job(
        [
            sys.executable,
            "-m",
            "lit_titan.train",
            *TINY,
            "cluster=gpu_1",
            "trainer.max_steps=6",
            "trainer.log_every_n_steps=1",
            "callbacks=[throughput,timeline,profiler]",
            "callbacks.profiler.steps=[3,4]",
            f"run_dir={run_dir}",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _timeline(run_dir, 0)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert sum(r[f"{p}_s"] for p in PHASES) + r["other_s"] == pytest.approx(r["wall_s"], rel=1e-3, abs=1e-4)
        assert r["forward_s"] > 0 and r["peak_reserved_mib"] >= r["peak_mem_mib"] > 0
    assert (run_dir / "profile" / "step-000003" / "rank-0.memory.pickle").stat().st_size > 0
    names = {
        e.get("name", "")
        for e in json.loads(gzip.decompress((run_dir / "profile" / "step-000003" / "rank-0.json.gz").read_bytes()))[
            "traceEvents"
        ]
    }
    assert NAMED <= names
