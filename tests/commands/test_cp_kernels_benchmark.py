"""benchmarks/cp_kernels.py's CPU smoke mode: every mode's row, and the ring kernel equal to whole-sequence SDPA.

The figures mean nothing on CPU; this proves the plumbing the GPU run relies on (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from helpers import run_job
from paths import ROOT


@pytest.mark.slow
def test_cp_kernels_cpu_smoke(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_job([sys.executable, str(ROOT / "benchmarks" / "cp_kernels.py"), "--cpu-smoke", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(re.search(r"max difference (\S+)", proc.stdout).group(1))
    assert err < 1e-10, proc.stdout
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["sdpa", "allgather", "ulysses", "ring"]
    assert all(r["tokens_per_s"] > 0 and r["peak_mib"] is None for r in rows), rows
