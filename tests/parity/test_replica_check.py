"""The replica-divergence check (``lit_titan/callbacks/replica_check.py``): after every step, each tensor that
several ranks hold a copy of (HSDP replicas, tensor-parallel copies, their optimizer moments, an MoE layer's
expert bias) is bitwise equal on all of them; a copy that drifts is found by name and mesh dim.

Three steps per case (fp32: bitwise equality does not depend on the dtype).
"""

from __future__ import annotations

import pytest

from parity import MOE, PARITY

pytestmark = [pytest.mark.slow, pytest.mark.parity]

STEPS = [*PARITY, "trainer.max_steps=3", "checkpoint.enabled=false"]
LAYOUTS = {
    "hsdp2x2": ["cluster.devices=4", "parallel.dp_replicate=2"],
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "ep2": [*MOE, "cluster.devices=2", "parallel.ep=2"],
}


def _check(worlds, tmp_path, case: str, mutant: str | None = None) -> dict:
    from world import devices_of

    argv = [*STEPS, *LAYOUTS[case], f"run_dir={tmp_path / case}"]
    return worlds.run(devices_of(argv), "parity:replica_check_case", argv, mutant).value


@pytest.mark.parametrize("case", LAYOUTS)
def test_replicated_state_stays_bitwise_equal(case, worlds, tmp_path):
    got = _check(worlds, tmp_path, case)
    assert got["checked"] > 0 and got["divergent"] == [], got


@pytest.mark.parametrize(
    ("mutant", "case", "named"),
    [
        ("silent_corruption_on_one_rank", "hsdp2x2", "[dp_replicate]"),
        ("expert_bias_from_one_rank", "ep2", "expert_bias [world]"),
    ],
)
def test_a_copy_that_drifts_is_found_by_name(mutant, case, named, worlds, tmp_path):
    got = _check(worlds, tmp_path, case, mutant)
    print(f"{mutant} on {case}: {len(got['divergent'])} divergent, first {got['divergent'][:1]}")
    assert any(named in entry for entry in got["divergent"]), got["divergent"][:5]
