"""benchmarks/cp_kernels.py's CPU smoke mode: every mode's row, and the ring kernel equal to whole-sequence SDPA.

The figures mean nothing on CPU; this proves the plumbing the GPU run relies on (docs/benchmarks.md). The script
runs in this process (its ``main(argv)``): it needs no process group or environment of its own, and a fresh
interpreter would cost more than the smoke run itself.
"""

from __future__ import annotations

import importlib.util
import json
import re

from paths import ROOT


def test_cp_kernels_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("cp_kernels", ROOT / "benchmarks" / "cp_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(["--cpu-smoke", "--json", str(out)])
    printed = capsys.readouterr().out
    err = float(re.search(r"max difference (\S+)", printed).group(1))
    assert err < 1e-10, printed
    assert json.loads(out.read_text()) == rows
    assert [r["mode"] for r in rows] == ["sdpa", "allgather", "ulysses", "ring"]
    assert all(r["tokens_per_s"] > 0 and r["peak_mib"] is None for r in rows), rows
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows), printed
