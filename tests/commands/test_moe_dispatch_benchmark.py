"""benchmarks/moe_dispatch.py's CPU smoke mode: the three timed paths run and agree on the FLOPs they count.

In-process (the script's ``main``), not a new interpreter: nothing here needs a command line's exit code
but the GPU-less refusal, checked through the same ``main``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from paths import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("moe_dispatch", ROOT / "benchmarks" / "moe_dispatch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_moe_dispatch_cpu_smoke(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "moe.json"
    r = bench.main(["--cpu-smoke", "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == r
    assert set(r["ms"]) == {"moe", "experts", "dense"} and all(v > 0 for v in r["ms"].values()), r
    # equal active FLOPs: the same count divides every path's time
    assert r["tflops"]["moe"] * r["ms"]["moe"] == pytest.approx(r["tflops"]["dense"] * r["ms"]["dense"], rel=1e-9)
    assert 1.0 <= r["load_max_mean"] <= r["experts"] / r["top_k"]
    printed = capsys.readouterr().out
    assert "CPU smoke: plumbing only" in printed and "| moe |" in printed and "| dense |" in printed
    if not __import__("torch").cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            bench.main([])
        assert exc.value.code == 2 and "moe_dispatch: error: --cpu-smoke=false" in capsys.readouterr().err
