"""The known-norm check (``lit_titan/callbacks/known_norm.py``): with every gradient set to one, the global norm the
module clips with equals sqrt(parameters) under every mesh, with no reference run; a parameter left out of the
norm, or counted twice, misses it.

One optimizer step in float64 per case; the correct layouts meet it to 1e-12, each planted bug misses by more
than 1e6x that.
"""

from __future__ import annotations

import pytest

from parity import MOE, PARITY

pytestmark = [pytest.mark.slow, pytest.mark.parity]

TOL = 1e-12
ONE_STEP = [*PARITY, "precision=64-true", "trainer.max_steps=1", "checkpoint.enabled=false"]
LAYOUTS = {
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "pp2": ["cluster.devices=2", "parallel.pp=2"],
    "ep2xtp2": [*MOE, "cluster.devices=4", "parallel.ep=2", "parallel.tp=2"],
}
# mutant -> the layout it runs on: each drops a parameter's share from the norm, or counts one twice
MUTANTS = {
    "grad_norm_local_shard": "tp2",
    "grad_norm_misses_pp_stages": "pp2",
    "grad_norm_counts_experts_twice": "ep2xtp2",
}


def _gap(worlds, tmp_path, case: str, mutant: str | None = None) -> float:
    argv = [*ONE_STEP, *LAYOUTS[case], f"run_dir={tmp_path / case}"]
    from world import devices_of

    got = worlds.run(devices_of(argv), "parity:known_norm_case", argv, mutant).value
    assert got["expected"] and got["measured"], got
    return abs(got["measured"] - got["expected"]) / got["expected"]


@pytest.mark.parametrize("case", LAYOUTS)
def test_all_ones_gradients_have_the_known_norm(case, worlds, tmp_path):
    assert _gap(worlds, tmp_path, case) < TOL


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_parameter_left_out_of_the_norm_or_counted_twice_misses_it(mutant, worlds, tmp_path):
    gap = _gap(worlds, tmp_path, MUTANTS[mutant], mutant)
    print(f"{mutant} on {MUTANTS[mutant]}: the norm off by {gap:.3g}, {gap / TOL:.3g}x the tolerance")
    assert gap > 1e6 * TOL, gap
