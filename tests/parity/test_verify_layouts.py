"""``lit-titan verify``'s procedure (lit_titan/verify/) on the parity suite's layouts and mutants.

Each case is ``run_verify`` itself (shrink, both sides, the judgement, the known norm, the replicas) with the
tests' reused process worlds as its runner, so a mutant (tests/support/mutants/) can be applied to the layout
side. The command line itself is tests/commands/test_verify_command.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import TINY
from parity import MOE

pytestmark = [pytest.mark.slow, pytest.mark.parity]

# A job as a user writes it: the verify shrinks it (layers, sequence, batch, steps) and trains it in float64.
JOB = [*TINY, "seed=0", "optim.lr=1e-2", "trainer.gradient_clip_val=0.3", "trainer.max_steps=100"]
LAYOUTS = {
    "dp2_accum2": ["cluster.devices=2", "data.micro_batch_size=2"],
    "hsdp2x2": ["cluster.devices=4", "parallel.dp_replicate=2"],
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "pp2xtp2": ["cluster.devices=4", "parallel.pp=2", "parallel.tp=2"],
    "cp2_ring": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ring"],
    "moe_ep2xtp2": [*MOE, "cluster.devices=4", "parallel.ep=2", "parallel.tp=2"],
}
MASKED = ["module._target_=user_modules.MaskedLabels"]
# mutant -> the layout it is planted in: a reduction, the normaliser (a user's module with unequal counts), the
# norm (and the known norm), and replicated state drifting on one rank.
MUTANTS = {
    "tp_dropped_reduction": LAYOUTS["tp2"],
    "fsdp_sums_gradients": LAYOUTS["dp2_accum2"],
    "normaliser_per_rank_mean": [*MASKED, "cluster.devices=2", "parallel.cp=2"],
    "grad_norm_local_shard": LAYOUTS["tp2"],
    "grad_norm_misses_pp_stages": ["cluster.devices=2", "parallel.pp=2"],
    "silent_corruption_on_one_rank": LAYOUTS["hsdp2x2"],
}


class WorldRunner:
    """``check.Runner`` on the reused worlds; a reference of an identical shrunk job is run once and copied."""

    def __init__(self, worlds, mutant: str | None = None) -> None:
        self.worlds, self.mutant = worlds, mutant

    def __call__(self, side, overrides, run_dir: Path, steps, known_norm_step, processes) -> None:
        from lit_titan.config import compose

        key = compose(overrides).__repr__() if side == "reference" else None
        if key in _REFERENCES:
            shutil.copytree(_REFERENCES[key], run_dir)
            return
        mutant = self.mutant if side == "layout" else None
        self.worlds.run(
            processes, "parity:verify_side_case", overrides, str(run_dir), steps, known_norm_step, mutant, timeout=600
        )
        if key is not None:
            _REFERENCES[key] = run_dir


_REFERENCES: dict[str, Path] = {}


def _verify(worlds, overrides: list[str], out: Path, mutant: str | None = None):
    from lit_titan.verify.check import run_verify

    verdict = run_verify([*JOB, *overrides, f"run_dir={out}"], WorldRunner(worlds, mutant))
    print(verdict.render())
    return verdict


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_passes_every_layout(layout, worlds, tmp_path):
    verdict = _verify(worlds, LAYOUTS[layout], tmp_path)
    assert verdict.passed, verdict.margin
    assert max(r for r, _ in verdict.norms) > 0.3, "clipping never engaged"  # the job's clip, engaged
    assert verdict.known_norm is not None and verdict.known_norm_error < 1e-12
    assert not verdict.replicas["divergent"]
    assert verdict.replicas["checked"] > 0 or layout in ("dp2_accum2", "cp2_ring")  # FSDP alone holds no copies
    assert (tmp_path / "verify.csv").exists() and "verdict: PASS" in (tmp_path / "verify.txt").read_text()


@pytest.mark.parametrize("mutant", MUTANTS)
def test_verify_fails_each_mutant_naming_it(mutant, worlds, tmp_path):
    verdict = _verify(worlds, MUTANTS[mutant], tmp_path, mutant)
    ratio, what = verdict.margin
    print(f"verify margin on {mutant}: {ratio:.3g}x ({what})")
    assert not verdict.passed
    if mutant == "silent_corruption_on_one_rank":  # one ulp: below the tolerance, found bitwise by the replicas
        assert verdict.replicas["divergent"], verdict.replicas
    else:
        assert ratio >= 1e6, what
        assert "step" in what or "known norm" in what  # the worst entry names where it was


# ---- the optimizer x family matrix ---------------------------------------------------------------------------
# Every optimizer and state precision trains each family equal to one process under a sharded layout: FSDP over
# two ranks for the dense model (Muon gathers each sharded matrix to orthogonalise it, LAMB sums its trust-ratio
# norms over the shards), expert parallel for the MoE model (its experts one stacked [experts, out, in] weight per
# projection, split over the ep ranks). bf16 states round stochastically with noise keyed by each element's index
# in the whole parameter, so the shards draw what one process draws (optim/low_precision.py).
OPTIMIZERS = {
    "adamw": ["optim=adamw"],
    "adamw_bf16": ["optim=adamw", "optim.state_dtype=bf16"],
    "lamb": ["optim=lamb", "optim.lr=1e-2"],
    "lamb_bf16": ["optim=lamb", "optim.lr=1e-2", "optim.state_dtype=bf16"],
    "muon": ["optim=muon", "optim.lr=1e-2"],
    "muon_bf16": ["optim=muon", "optim.lr=1e-2", "optim.state_dtype=bf16"],
}
FAMILIES = {"dense": ["cluster.devices=2"], "moe": [*MOE, "cluster.devices=2", "parallel.ep=2"]}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_trains_every_family_equal_to_one_process(optimizer, family, worlds, tmp_path):
    verdict = _verify(worlds, [*FAMILIES[family], *OPTIMIZERS[optimizer]], tmp_path)
    assert verdict.passed, verdict.margin
