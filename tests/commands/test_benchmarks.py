"""The side-by-side benchmarks' CPU smoke modes: every row, positive figures.

The figures mean nothing on CPU; these tests prove the plumbing a GPU run relies on: both sides
train every configuration of the table, the bare loop really applies Float8 and selective AC, and
TorchTitan's model has exactly lit-titan's parameter count.
"""

from __future__ import annotations

import json
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
