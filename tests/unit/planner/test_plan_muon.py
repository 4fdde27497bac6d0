"""Muon's step-time term in the planner: the closed form against a hand count and torch's FLOP counter,
and the term in the step the plan, the search and the calibration predict (planner/optimizer_state.py)."""

from __future__ import annotations

import pytest
import torch


def test_newton_schulz_flops_are_what_the_implementation_runs():
    """The closed form counts the matmuls of ``optim.muon.newton_schulz`` (torch's FLOP counter), tall and wide."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_titan.optim.muon import newton_schulz
    from lit_titan.planner.optimizer_state import newton_schulz_flops

    for m, n in ((24, 40), (40, 24), (3 * 16, 16)):
        counter = FlopCounterMode(display=False)
        with counter:
            newton_schulz(torch.randn(m, n), steps=3)
        assert counter.get_total_flops() == newton_schulz_flops(m, n, 3), (m, n)
    # by hand: Llama 3.1 8B's w2 (4096 x 14336), 5 iterations: 5 x (4 * 4096^2 * 14336 + 2 * 4096^3)
    assert newton_schulz_flops(4096, 14336, 5) == 5 * (4 * 4096 * 4096 * 14336 + 2 * 4096**3) == 5_497_558_138_880


@pytest.fixture(scope="module")
def llama8b_h100():
    from lit_titan.config import compose

    common = ["model=llama3_8b", "cluster=h100_8", "data.seq_len=8192", "data.global_batch_size=8", "callbacks=[]"]
    return {name: compose([*common, f"optim={name}"]) for name in ("adamw", "muon")}


def test_muon_step_term_is_the_gather_plus_fp32_newton_schulz(llama8b_h100):
    """Llama 3.1 8B under FSDP over 8 H100s (bf16-mixed): the step gains, by hand, every block's 7 matrices'
    Newton-Schulz FLOPs at the fp32 (non-tensor-core: bf16-mixed leaves torch's matmul precision at
    "highest") rate, plus 7/8 of every matrix in fp32 over NVLink; nothing else moves."""
    from lit_titan.planner.calibrate import predict
    from lit_titan.planner.cp_modes import FP32_MATH_SLOWDOWN
    from lit_titan.planner.estimate import DEFAULT_EFFICIENCIES as eff

    adamw, muon = (predict(llama8b_h100[k], eff) for k in ("adamw", "muon"))
    h, kv, f, layers, steps = 4096, 1024, 14336, 32, 5

    def ns(m, n):  # one matrix, 5 iterations: 5 (4 s^2 l + 2 s^3)
        s, big = min(m, n), max(m, n)
        return steps * (4 * s * s * big + 2 * s**3)

    flops = layers * (2 * ns(h, h) + 2 * ns(kv, h) + 3 * ns(f, h))
    numel = layers * (2 * h * h + 2 * kv * h + 3 * f * h)
    assert muon["muon_flops"] == pytest.approx(flops, rel=1e-12)
    assert flops == pytest.approx(666.1e12, rel=1e-3)  # docs/optimizers.md's table
    rate = 989e12 / FP32_MATH_SLOWDOWN * eff.compute
    gather = 7 / 8 * numel * 4 / (450e9 * eff.comm)
    assert muon["muon_newton_schulz_s"] == pytest.approx(flops / rate, rel=1e-9)
    assert muon["muon_gather_s"] == pytest.approx(gather, rel=1e-9)
    assert muon["step_s"] - adamw["step_s"] == pytest.approx(flops / rate + gather, rel=1e-9)
    assert adamw["muon_s"] == 0.0


def test_plan_and_search_count_muon(llama8b_h100, tmp_path):
    """``lit-titan plan`` prints the term; the search's candidates carry it (a pipeline stage orthogonalises
    only its own blocks' matrices: pp2 halves it)."""
    from lit_titan.cli.plan import make_plan
    from lit_titan.config.spec import model_args
    from lit_titan.planner import estimate
    from lit_titan.planner.core import render_table
    from lit_titan.planner.optimizer_state import optimizer_states
    from lit_titan.planner.search import Candidate, evaluate
    from lit_titan.strategies.parallel_dims import ParallelDims

    plan = make_plan(
        [
            "model=llama3_debug",
            "cluster=h100_8",
            "cluster.devices=1",
            "optim=muon",
            "callbacks=[]",
            f"run_dir={tmp_path}",
        ]
    )
    assert plan["perf"]["muon_s"] > 0 and "\nmuon: " in render_table(plan)
    cfg = llama8b_h100["muon"]

    args = model_args(cfg)
    cands = [
        Candidate(ParallelDims(world_size=8, dp_shard=8), None, 1, 1, 1, 1, 1, "full", False, "every_microbatch"),
        Candidate(
            ParallelDims(world_size=8, dp_shard=4, pp=2), "1F1B", 1, 1, 2, 1, 2, "full", False, "every_microbatch"
        ),
    ]
    evaluate(
        cands,
        args,
        dict(cfg.cluster),
        precision="bf16-mixed",
        seq_len=8192,
        global_batch=8,
        flops_per_token=6 * 8e9,
        eff=estimate.DEFAULT_EFFICIENCIES,
        optimizer="fused",
        optimizer_states=optimizer_states(cfg),
    )
    fsdp, pp2 = (c.perf for c in cands)
    assert pp2["muon_flops"] == pytest.approx(fsdp["muon_flops"] / 2)
    assert fsdp["muon_s"] > 10  # fp32 Newton-Schulz of 6.98B elements per rank: the step's largest term
