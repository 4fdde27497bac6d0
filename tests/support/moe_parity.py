"""The MoE family's parity regime: tests/support/parity.py's harness on a tiny Qwen3-MoE, one shared reference.

Both balancing methods on: DeepSeek-V3's sequence-wise auxiliary loss (per sequence, so any split of the
global batch over ranks and micro-batches gives the one-process gradient exactly) and the aux-loss-free
expert bias (token counts summed over the step's micro-batches and the data ranks); the dump compares the
bias with the weights. The coefficient is large enough that the auxiliary loss's gradient shows in the
router's (0.01 of a cross entropy near 6).
"""

from __future__ import annotations

from pathlib import Path

from parity import run_layout

MOE = [
    "model=qwen3_moe_debug",
    "model.head_dim=16",
    "model.ffn_dim=128",
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.hidden_dim=32",
    "model.moe.aux_loss=sequence",
    "model.moe.aux_loss_coef=0.01",
    "model.moe.bias_update_rate=0.001",
]

# Each parallelism with accumulation at least once; kept few (the suite's time budget).
MOE_CASES: dict[str, list[str]] = {
    "moe_dp2_accum2": ["cluster.devices=2", "data.micro_batch_size=2"],
    "moe_tp2": ["cluster.devices=2", "parallel.tp=2"],
    "moe_dp2_tp2_accum2": ["cluster.devices=4", "parallel.tp=2", "data.micro_batch_size=2"],
}


def run_moe_reference(worlds, run_dir: Path) -> Path:
    return run_layout(worlds, [*MOE, "cluster.devices=1"], run_dir)


def run_moe_case(worlds, case: str, run_dir: Path, mutant: str | None = None) -> Path:
    return run_layout(worlds, [*MOE, *MOE_CASES[case]], run_dir, mutant)


def first_step_margin(worlds, case: str, reference: Path, run_dir: Path, mutant: str) -> tuple[float, str]:
    """A mutant's largest error / tolerance over step 0's pre-clip gradients and clip norm: one step is
    enough for a bug that changes every gradient (and costs an eighth of the run)."""
    from parity import TOL, compare

    run_layout(worlds, [*MOE, *MOE_CASES[case], "trainer.max_steps=1"], run_dir, mutant, steps=[0])
    report = compare(reference / "dump", run_dir / "dump", steps=[0])
    report.worst.pop("params", None)  # after the step: the one-step run's LR schedule is another
    return report.margin(TOL)
