"""The mutant suite: every planted bug in tests/support/mutants/ makes the parity check that targets it fail,
by at least 10x its tolerance.

One run per mutant, in the reused worlds, against the session's shared one-process reference
(tests/support/parity.py). The margin is the largest error / tolerance over the kinds the parity check
compares (loss, pre-clip gradients, clip norm, post-step weights). The measured table goes to
``$MUTANT_TABLE`` when set (docs/testing.md, "Mutants", is that output).
"""

from __future__ import annotations

import json
import os

import pytest

from mutants import MUTANTS
from parity import TOL, measure, run_case

pytestmark = pytest.mark.slow

MIN_MARGIN = 10.0

# mutant -> (the parity test that must catch it, its case in parity.CASES)
TARGETS = {
    "cp_rope_rank0_positions": ("test_context_parallel.py::test_context_parallel_matches_single_process", "cp2"),
    "cp_allgather_backward_local": ("test_context_parallel.py::test_context_parallel_matches_single_process", "cp2"),
    "pp_loss_scale_ignores_accumulation": ("test_pipeline.py::test_pipeline_matches_single_process",
                                           "pp2_1F1B_accum2"),
    "pp_drops_last_microbatch": ("test_pipeline.py::test_pipeline_matches_single_process", "pp2_1F1B_accum2"),
    "grad_norm_misses_pp_stages": ("test_pipeline.py::test_pipeline_matches_single_process", "pp2_1F1B_accum2"),
    "grad_norm_local_shard": ("test_parallel.py::test_layout_matches_single_process", "dp2"),
    "fsdp_sums_gradients": ("test_parallel.py::test_layout_matches_single_process", "dp2"),
    "data_order_depends_on_dp": ("test_parallel.py::test_layout_matches_single_process", "dp2"),
    "hsdp_replicate_sums": ("test_parallel.py::test_layout_matches_single_process", "hsdp2x2_accum2"),
    "tp_dropped_reduction": ("test_parallel.py::test_layout_matches_single_process", "tp2"),
    "resume_skips_optimizer_state": ("test_parallel.py::test_resume_into_dp2_continues_the_single_process_run",
                                     "resume_dp2"),
    "resume_skips_data_position": ("test_parallel.py::test_resume_into_dp2_continues_the_single_process_run",
                                   "resume_dp2"),
    "resume_skips_lr_scheduler": ("test_parallel.py::test_resume_into_dp2_continues_the_single_process_run",
                                  "resume_dp2"),
}


def test_every_mutant_has_a_target():
    assert set(TARGETS) == set(MUTANTS) and len(MUTANTS) >= 12


def test_every_mutant_is_caught_with_a_10x_margin(parity_reference, tmp_path, worlds):
    rows = []
    for name, (test, case) in TARGETS.items():
        report = measure(case, parity_reference, run_case(worlds, case, tmp_path / name, parity_reference, mutant=name))
        ratio, what = report.margin(TOL)
        rows.append({"mutant": name, "bug": MUTANTS[name].bug, "where": MUTANTS[name].where,
                     "test": f"{test}[{case}]", "margin": ratio, "effect": what})
    table = ["| mutant | bug | caught by | effect (tolerance) | margin |", "| --- | --- | --- | --- | --- |"]
    table += [f"| `{r['mutant']}` | {r['bug']} (`{r['where']}`) | `{r['test']}` | {r['effect']} | "
              f"{r['margin']:.3g}x |" for r in rows]
    print("\n".join(table))
    if os.environ.get("MUTANT_TABLE"):
        with open(os.environ["MUTANT_TABLE"], "w") as f:
            f.write("\n".join(table) + "\n")
            json.dump(rows, f, indent=1)
    weak = [f"{r['mutant']}: {r['margin']:.3g}x ({r['effect']})" for r in rows if not r["margin"] >= MIN_MARGIN]
    assert not weak, "mutants not caught by a 10x margin:\n" + "\n".join(weak)
