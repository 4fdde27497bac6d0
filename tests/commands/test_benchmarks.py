"""The side-by-side benchmarks' CPU smoke modes: every row, positive figures.

The figures mean nothing on CPU; these tests prove the plumbing a GPU run relies on: both sides
train every configuration of the table, the bare loop really applies Float8 and selective AC, and
TorchTitan's model has exactly lit-titan's parameter count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import run_job
from paths import ROOT

BENCHMARKS = ROOT / "benchmarks"
SMOKE = ["--cpu-smoke", "--steps", "2", "--warmup", "1"]


def _smoke(script: str, tmp_path: Path) -> tuple[list[str], dict | list]:
    out = tmp_path / "results.json"
    proc = run_job([sys.executable, str(BENCHMARKS / script), *SMOKE, "--json", str(out)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert not any("failed" in line for line in table), "\n".join(table)
    return table, json.loads(out.read_text())


@pytest.mark.slow
def test_vs_bare_loop_cpu_smoke(tmp_path):
    rows = [
        "bf16_eager",
        "bf16_compile",
        "compile_float8_tensorwise",
        "compile_float8_rowwise",
        "compile_ac_selective_op",
    ]  # the GPU table's rows (docs/benchmarks.md)
    table, results = _smoke("vs_bare_loop.py", tmp_path)
    assert [line.split("|")[1].strip() for line in table[2:]] == rows
    assert [r["name"] for r in results] == rows
    for r in results:
        assert r["bare"]["tokens_per_sec"] > 0 and r["lit"]["perf/tokens_per_sec_per_device"] > 0, r
        assert (r["bare"]["float8_linears"] > 0) == ("float8" in r["name"]), r  # emulated, but converted
        assert r["bare"]["checkpointed_blocks"] == (2 if "ac_selective" in r["name"] else 0), r


@pytest.mark.slow
def test_vs_torchtitan_cpu_smoke(tmp_path):
    pytest.importorskip("torchtitan", reason="TorchTitan is in the test extra: pip install -e '.[test]'")
    rows = ["bf16_eager", "bf16_compile", "compile_ac_selective_op", "compile_float8_rowwise"]
    table, results = _smoke("vs_torchtitan.py", tmp_path)
    assert [line.split("|")[1].strip() for line in table[2:]] == rows
    assert [r["name"] for r in results["rows"]] == rows
    for r in results["rows"]:
        assert r["torchtitan"]["tokens_per_sec"] > 0 and r["lit"]["perf/tokens_per_sec_per_device"] > 0, r
        # the same model: TorchTitan's fused-qkv Llama and lit-titan's count the same parameters
        assert r["torchtitan"]["params"] == results["lit_params"] == 2_753_792, r


# ---- benchmarks/gpu_proof.py: the one command of a device call ------------------------------------
def _gpu_proof():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_proof", BENCHMARKS / "gpu_proof.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_proof_smoke_runs_every_step_and_reports(tmp_path):
    """Every step's orchestration on CPU: the cheap benchmarks' smoke modes, dry runs of the costly ones."""
    proof = _gpu_proof()
    out = tmp_path / "out"
    proof.main(["--smoke", "--out", str(out), "--wheels", str(tmp_path / "no-wheels"), "--site", str(tmp_path / "s")])
    report = json.loads((out / "proof.json").read_text())
    assert {"device", "torch", "date", "command", "versions"} <= report.keys()
    names = ["install", *(s.name for s in proof.steps())]
    assert [s["step"] for s in report["steps"]] == names
    status = {s["step"]: s["status"] for s in report["steps"]}
    assert status.pop("install").startswith("skipped (no wheels"), report
    assert set(status.values()) == {"ok"}, status
    figures = {s["step"]: s["figures"] for s in report["steps"]}
    assert figures["planner"]["peak_gib"]["bf16_compile"] > 0
    assert figures["gpu_tests"]["collected"] >= 4  # the gpu-marked tests exist under these names
    assert figures["moe_dispatch"]["moe_ms"] > 0 and figures["cp_kernels"]["ring_cp2_256"].endswith("MiB")
    table = (out / "proof.md").read_text().splitlines()
    assert "| step | status | seconds | figures |" in table and len([t for t in table if t.startswith("| ")]) == 12
    assert (out / "logs" / "checkpoint_stall.log").read_text().startswith("usage: checkpoint_stall.py")


def test_gpu_proof_reads_each_benchmarks_output_and_kills_a_slow_step(tmp_path):
    """The figures of the costly steps from their JSON shapes; a step past its limit is killed, not waited for."""
    proof = _gpu_proof()
    bare = {"name": "bf16_compile", "bare": {"tokens_per_sec": 40000.0, "max_memory_allocated_gib": 30.0}}
    bare["lit"] = {"perf/tokens_per_sec_per_device": 42000.0, "perf/mfu": 0.5, "perf/max_memory_allocated_gib": 33.0}
    (tmp_path / "bare.json").write_text(json.dumps([bare]))
    got = proof.with_prediction(
        None, proof.bare_figures(tmp_path / "bare.json", ""), {"peak_gib": {"bf16_compile": 35}}
    )
    assert got["lit_over_bare"] == 1.05 and got["lit_peak_gib"] == 33.0 and got["planner_peak_gib"] == 35
    tt = {"lit_params": 7, "rows": [{"name": "bf16_compile", "torchtitan": {"error": "boom"}, "lit": bare["lit"]}]}
    (tmp_path / "tt.json").write_text(json.dumps(tt))
    got = proof.torchtitan_figures(tmp_path / "tt.json", "")
    assert got["torchtitan_error"] == "boom" and got["lit_tokens_per_s"] == 42000.0 and "lit_over_torchtitan" not in got
    save = {"state_bytes": 2e9, "blocked_s": 0.5, "one_copy_s": 0.4, "ratio": 1.25, "complete_s": 3.0}
    stall = {"rows": [{**save, "blocked_s": 2.0}, save], "median_step_s": 0.3}
    (tmp_path / "stall.json").write_text(json.dumps(stall))
    assert proof.stall_figures(tmp_path / "stall.json", "")["later_blocked_over_copy"] == [1.25]
    states = {"predicted": {"checkpoint_state_bytes": {"8b_width_4_layers": 23e9, "vocab_32000": 14e9}}}
    (tmp_path / "planner.json").write_text(json.dumps(states))
    assert proof.stall_job(tmp_path / "planner.json", 40 * 2**30) == "vocab_32000"  # two 23 GB saves do not fit
    assert proof.tests_figures(None, "FAILED a.py::t - x\n1 failed, 3 passed, 1 skipped in 9s") == {
        "failed": 1,
        "passed": 3,
        "skipped": 1,
        "failures": ["a.py::t"],
    }
    slow = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"]
    status, seconds, _ = proof.run_step(slow, 2, tmp_path / "slow.log", dict(os.environ))
    assert status == "timed out (2 s)" and seconds < 30
