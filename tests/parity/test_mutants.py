"""The mutant suite: every planted bug in tests/support/mutants/ makes the parity check that targets it fail,
by at least 10x its tolerance.

One run per mutant, in the reused worlds, against the session's shared one-process reference
(tests/support/parity.py); a mutant of code every layout shares (``REFERENCE_TARGETS``) runs instead against
the independent reference of tests/parity/test_hf_reference.py, in this process. The margin is the largest
error / tolerance over the kinds the parity check compares (loss, pre-clip gradients, clip norm,
post-step weights). The measured table goes to
``$MUTANT_TABLE`` when set (docs/testing.md, "Mutants", is that output).
"""

from __future__ import annotations

import json
import os

import pytest

from mutants import MUTANTS, applied
from parity import EP_CASES, MOE, SEQUENCE_AUX, TOL, compare, measure, run_case, run_ep_case, run_layout

pytestmark = pytest.mark.slow

MIN_MARGIN = 10.0

# mutant -> (the parity test that must catch it, its case in parity.CASES)
TARGETS = {
    "cp_rope_rank0_positions": ("test_context_parallel.py::test_context_parallel_matches_single_process", "cp2"),
    "cp_allgather_backward_local": ("test_context_parallel.py::test_context_parallel_matches_single_process", "cp2"),
    "pp_loss_scale_ignores_accumulation": ("test_pipeline.py::test_pipeline_matches_single_process", "pp2_1F1B_accum2"),
    "pp_drops_last_microbatch": ("test_pipeline.py::test_pipeline_matches_single_process", "pp2_1F1B_accum2"),
    "grad_norm_misses_pp_stages": ("test_pipeline.py::test_pipeline_matches_single_process", "pp2_1F1B_accum2"),
    "grad_norm_local_shard": ("test_parallel.py::test_layout_matches_single_process", "dp2"),
    "fsdp_sums_gradients": ("test_parallel.py::test_layout_matches_single_process", "dp2"),
    "data_order_depends_on_dp": ("test_parallel.py::test_layout_matches_single_process", "dp2"),
    "hsdp_replicate_sums": ("test_parallel.py::test_layout_matches_single_process", "hsdp2x2_accum2"),
    "tp_dropped_reduction": ("test_parallel.py::test_layout_matches_single_process", "tp2"),
    "resume_skips_optimizer_state": (
        "test_parallel.py::test_resume_into_dp2_continues_the_single_process_run",
        "resume_dp2",
    ),
    "resume_skips_data_position": (
        "test_parallel.py::test_resume_into_dp2_continues_the_single_process_run",
        "resume_dp2",
    ),
    "resume_skips_lr_scheduler": (
        "test_parallel.py::test_resume_into_dp2_continues_the_single_process_run",
        "resume_dp2",
    ),
    "loss_parallel_local_logsumexp": ("test_parallel.py::test_layout_matches_single_process", "tp2"),
    "cp_ring_merge_without_lse_rescale": ("test_cp_modes.py::test_cp_mode_matches_single_process", "cp2_ring"),
    "cp_ring_chunk_mask_off_by_one": ("test_cp_modes.py::test_cp_mode_matches_single_process", "cp2_ring"),
    "cp_ulysses_all_to_all_wrong_dim": ("test_cp_modes.py::test_cp_mode_matches_single_process", "cp2_ulysses"),
}

# Expert-parallel mutants: mutant -> (the test, its case in parity.EP_CASES), against the MoE reference.
EP_TARGETS = {
    "ep_expert_grads_mean_over_efsdp": ("test_expert_parallel.py::test_expert_parallel_matches_single_process", "ep2"),
    "expert_bias_from_one_rank": ("test_expert_parallel.py::test_expert_parallel_matches_single_process", "ep2"),
    "ep_tp_router_grad_not_reduced": (
        "test_expert_parallel.py::test_expert_parallel_matches_single_process",
        "ep2xtp2",
    ),
    "step_counts_one_rank": (
        "test_expert_parallel.py::test_expert_parallel_matches_single_process",
        "ep2_accum2_global_step",
    ),
}

# Expert-parallel mutants checked on step 0 alone (a bug in every step's expert gradients, in an 8-rank case):
# mutant -> (the test, its case in parity.EP_CASES).
EP_FIRST_STEP_TARGETS = {
    "moe_tp_swaps_expert_weights": (
        "test_expert_parallel.py::test_expert_parallel_matches_single_process",
        "pp2xep2xtp2",
    ),
}

# Mutants of code every layout shares (the data path's positions): the one-process reference has the same bug,
# so no parity case can see one. The independent reference catches them instead, in this process:
# mutant -> (the test, a function returning its worst relative gradient error and where, its tolerance).
REFERENCE_TARGETS = {
    "rope_positions_off_after_document": (
        "test_hf_reference.py::test_packed_documents_equal_each_document_alone_in_transformers",
        "test_hf_reference:packed_positions_error",
        "test_hf_reference:RTOL",
    ),
}


# Mutants caught, by the same 10x margin, by a test of their own: its case kills processes (no reused world), or
# needs another one-process reference (another optimizer, packed documents). The test named runs the mutant and asserts the margin.
OWN_TESTS = {
    "ft_survivors_keep_old_normaliser": "test_replica_loss.py::test_survivors_of_a_lost_replica_group_finish_equal_to_one_process",
    "ft_dead_samples_skipped": "test_replica_loss.py::test_survivors_of_a_lost_replica_group_finish_equal_to_one_process",
    "ft_rejoin_stale_weights": "test_replica_loss.py::test_survivors_of_a_lost_replica_group_finish_equal_to_one_process",
    "ft_pp_sum_skips_a_stage": "test_ft_trainer.py::test_trainer_survives_a_lost_replica_group_equal_to_one_process",
    "muon_orthogonalises_each_shard": "test_muon_parity.py::test_muon_mutant_orthogonalising_each_shard_is_caught",
    "cp_document_boundary_across_chunk": "test_cp_modes.py::test_document_masked_modes_match_single_process",
    "pp_aux_loss_unscaled": "test_expert_parallel.py::test_pipeline_aux_loss_mutant_is_caught_with_a_10x_margin",
    "eval_moves_expert_bias": "test_validation.py::test_moe_validation_under_expert_parallel_matches_and_moves_no_training_state",
    "normaliser_per_rank_mean": "test_user_loss.py::test_normaliser_mutants_are_caught_with_a_10x_margin",
    "normaliser_count_one_rank": "test_user_loss.py::test_normaliser_mutants_are_caught_with_a_10x_margin",
    "normaliser_per_micro_batch_mean": "test_user_loss.py::test_normaliser_mutants_are_caught_with_a_10x_margin",
    "grad_norm_counts_experts_twice": "test_known_norm.py::test_a_parameter_left_out_of_the_norm_or_counted_twice_misses_it",
    "silent_corruption_on_one_rank": "test_replica_check.py::test_a_copy_that_drifts_is_found_by_name",
}

# MoE mutants: against the MoE family's own one-process reference (tests/support/moe_parity.py), mutant ->
# (the parity test that must catch it, its case in moe_parity.MOE_CASES) ...
MOE_TARGETS = {
    "moe_router_grad_not_reduced_over_tp": ("test_moe_parity.py::test_moe_layout_matches_single_process", "moe_tp2"),
    "moe_capacity_drops_tokens": ("test_moe_parity.py::test_moe_layout_matches_single_process", "moe_dp2_accum2"),
}
# ... or, where the bug needs a planted state (every routing score tied), a function run in a 2-rank world
# returning the worst relative gradient error against one process, with its tolerance.
MOE_WORLD_TARGETS = {
    "moe_topk_ties_rank_dependent": (
        "test_moe_parity.py::test_routing_ties_break_alike_on_every_rank",
        "moe_tie_case:dp_ties_error",
        "test_moe_parity:TIE_TOL",
    ),
}


def _resolve(target: str):
    import importlib

    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def test_every_mutant_has_a_target():
    targeted = set(TARGETS) | set(EP_TARGETS) | set(EP_FIRST_STEP_TARGETS) | set(REFERENCE_TARGETS) | set(OWN_TESTS)
    targeted |= set(MOE_TARGETS)
    assert targeted | set(MOE_WORLD_TARGETS) == set(MUTANTS) and len(MUTANTS) >= 12


def _row(name: str, test: str, case: str, report) -> dict:
    ratio, what = report.margin(TOL)
    return {
        "mutant": name,
        "bug": MUTANTS[name].bug,
        "where": MUTANTS[name].where,
        "test": f"{test}[{case}]",
        "margin": ratio,
        "effect": what,
    }


def test_every_mutant_is_caught_with_a_10x_margin(parity_reference, tmp_path, worlds):
    rows = []
    for name, (test, case) in TARGETS.items():
        report = measure(case, parity_reference, run_case(worlds, case, tmp_path / name, parity_reference, mutant=name))
        rows.append(_row(name, test, case, report))
    for name, (test, measure_error, tolerance) in REFERENCE_TARGETS.items():
        with applied(name):
            err, where = _resolve(measure_error)()
        tol = _resolve(tolerance)
        rows.append(
            {
                "mutant": name,
                "bug": MUTANTS[name].bug,
                "where": MUTANTS[name].where,
                "test": test,
                "margin": err / tol,
                "effect": f"grads {where}: {err:.3g} (tolerance {tol:.1g})",
            }
        )
    _report(rows)


def test_expert_parallel_mutants_are_caught_with_a_10x_margin(
    ep_parity_reference, sequence_aux_reference, tmp_path, worlds
):
    """The same for the expert-parallel bugs, against the MoE reference (``parity.MOE``; the sequence-wise
    loss's for a case with it)."""
    rows = []
    for name, (test, case) in EP_TARGETS.items():
        report = measure(case, ep_parity_reference, run_ep_case(worlds, case, tmp_path / name, mutant=name))
        rows.append(_row(name, test, case, report))
    for name, (test, case) in EP_FIRST_STEP_TARGETS.items():
        reference = sequence_aux_reference if SEQUENCE_AUX[0] in EP_CASES[case] else ep_parity_reference
        run_layout(worlds, [*MOE, *EP_CASES[case], "trainer.max_steps=1"], tmp_path / name, name, steps=[0])
        report = compare(reference / "dump", tmp_path / name / "dump", steps=[0])
        report.worst.pop("params", None)  # after the step: the one-step run's LR schedule is another
        rows.append(_row(name, test, case, report))
    _report(rows, "MUTANT_TABLE_EP")


def _report(rows: list[dict], env: str = "MUTANT_TABLE") -> None:
    table = ["| mutant | bug | caught by | effect (tolerance) | margin |", "| --- | --- | --- | --- | --- |"]
    table += [
        f"| `{r['mutant']}` | {r['bug']} (`{r['where']}`) | `{r['test']}` | {r['effect']} | {r['margin']:.3g}x |"
        for r in rows
    ]
    print("\n".join(table))
    if os.environ.get(env):
        with open(os.environ[env], "w") as f:
            f.write("\n".join(table) + "\n")
            json.dump(rows, f, indent=1)
    weak = [f"{r['mutant']}: {r['margin']:.3g}x ({r['effect']})" for r in rows if not r["margin"] >= MIN_MARGIN]
    assert not weak, "mutants not caught by a 10x margin:\n" + "\n".join(weak)


def test_moe_mutants_are_caught_with_a_10x_margin(moe_parity_reference, tmp_path, worlds):
    """Each on step 0 of its case (gradients and clip norm), which every one of these bugs changes."""
    from moe_parity import first_step_margin

    weak = []
    for name, (test, case) in MOE_TARGETS.items():
        margin, what = first_step_margin(worlds, case, moe_parity_reference, tmp_path / name, name)
        print(f"{name}: caught at {margin:.3g}x ({what})")
        if not margin >= MIN_MARGIN:
            weak.append(f"{name} ({test}): {margin:.3g}x ({what})")
    for name, (test, target, tol) in MOE_WORLD_TARGETS.items():
        err = worlds.run(2, target, name).value
        print(f"{name}: caught at {err / _resolve(tol):.3g}x (error {err:.3g})")
        if not err / _resolve(tol) >= MIN_MARGIN:
            weak.append(f"{name} ({test}): {err / _resolve(tol):.3g}x (error {err:.3g})")
    assert not weak, "MoE mutants not caught by a 10x margin:\n" + "\n".join(weak)
