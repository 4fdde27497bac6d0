"""Calibrate the planner on a CPU dp2 run, predict dp4 and dp2 x tp2, print measured vs predicted.

    python benchmarks/planner_calibration_cpu.py RUN_DP2 RUN_DP4 RUN_DP2TP2

Each argument is the run_dir of a finished tiny CPU run (tests/support/helpers.py TINY, trainer.max_steps=12,
checkpoint.enabled=false; cluster.devices=2 / 4 / 4 with parallel.tp=2); docs/planner.md has the figures.
"""

import sys

from lit_titan.planner.calibrate import fit, measured, predict

if __name__ == "__main__":
    from omegaconf import OmegaConf

    from lit_titan.config import compose

    runs = [measured(d) for d in sys.argv[1:]]
    facts = compose([]).cluster  # this machine's profile (runs written before a fact was added lack it)
    for r in runs:
        for key in ("peak_fp32_tflops", "intra_node_gbps", "cores_per_node"):
            OmegaConf.update(r["cfg"], f"cluster.{key}", facts[key], force_add=True)
    eff = fit(runs[:1])
    print(
        f"fitted on {runs[0]['run_dir']}: compute {eff.compute:.4f}, comm {eff.comm} (default), "
        f"overhead {eff.overhead_s * 1e3:.1f} ms"
    )
    for r in runs:
        p = predict(r["cfg"], eff)["step_s"]
        print(
            f"{r['run_dir']}: measured {r['step_s'] * 1e3:.1f} ms/step (median of {r['steps']}, {r['source']}), "
            f"predicted {p * 1e3:.1f} ms, error {p / r['step_s'] - 1:+.0%}"
        )
