"""Expert parallel (``parallel.ep``) trains to the single-process gradients, norms, weights, losses and expert bias.

The tiny Qwen3-MoE of ``parity.MOE`` (two MoE layers, 8 experts, top 2) with both balancing methods on (the
global-batch auxiliary loss, or the sequence-wise one under gradient accumulation, and the auxiliary-loss-free
expert bias), in the parity regime of
``parity.PARITY`` (lr 1e-2, clipping engaged, 8 steps), against one one-process reference per session
(``ep_parity_reference``, shared with the EP mutants of test_mutants.py). Each case is the training entry
point in a reused gloo world with the dump of every pre-clip gradient (router and experts included), the clip
norm and the weights plus the expert bias after steps 0, 4 and 7; the logged auxiliary loss is compared too.
Under pipeline parallel (``pp2...`` cases: with ep, tp and cp, and under every schedule family, the zero-bubble
ones included) each stage's MoE layers back-propagate their own share of the auxiliary loss and update their own
expert biases (docs/moe.md). ep2 x tp2 splits the experts over ep x tp (each tp
rank dispatching its share of the tokens).
"""

import pytest

from helpers import read_metrics
from lit_titan.strategies.pipeline import ZERO_BUBBLE
from parity import (
    DUMP_STEPS,
    EP_CASES,
    MOE,
    RESUME_STEP,
    SEQUENCE_AUX,
    TOL,
    TOL32,
    check_case,
    load_dumps,
    measure,
    run_ep_case,
    run_layout,
)

pytestmark = [pytest.mark.slow, pytest.mark.parity]
# the schedules that split backward into input and weight gradients each have a case
assert all(any(f"_{s}" in case for case in EP_CASES) for s in ZERO_BUBBLE)


def aux_losses(run_dir) -> list[float]:
    return [float(r["train/aux_loss"]) for r in read_metrics(run_dir) if r.get("train/aux_loss")]


def check_ep_case(case, reference, got):
    """``parity.check_case`` plus the logged auxiliary loss of every step (relative to the reference's)."""
    report = check_case(case, reference, got)
    ref, ours = aux_losses(reference), aux_losses(got)
    assert ref and len(ours) <= len(ref), (ref, ours)
    worst = max(abs(g - r) / r for g, r in zip(ours, ref[len(ref) - len(ours) :]))
    # The logged auxiliary loss under pp (each stage's layers' mean share over their forwards, summed over the
    # stages) is off by up to 5e-8 in float64 while every gradient matches to 1e-14: not yet explained, so
    # it keeps the fp32 tolerance (docs/testing.md, "Float64").
    assert worst <= TOL32.loss, f"{case}: auxiliary loss off by {worst:.3g} (tolerance {TOL32.loss:.1g})"
    return report


def routing_changed(reference) -> float:
    """Share of 512 random hidden states whose top-k experts differ between the weights (router and expert
    bias) after step 0 and after the last step, over both MoE layers: the cases cover changing routing."""
    import torch

    from lit_titan.models.moe import stable_topk

    dumps = load_dumps(reference / "dump")
    first, last = dumps[DUMP_STEPS[0]]["params"], dumps[DUMP_STEPS[-1]]["params"]
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0), dtype=first["tok_embeddings.weight"].dtype)
    changed = []
    for layer in (0, 1):
        gate, bias = f"layers.{layer}.moe.router.gate.weight", f"layers.{layer}.moe.expert_bias"
        picks = [stable_topk((x @ p[gate].T).softmax(-1) + p[bias], 2).sort(-1).values for p in (first, last)]
        changed.append((picks[0] != picks[1]).any(-1).float().mean().item())
    return min(changed)


@pytest.fixture(scope="module")
def ep2xdp2_run(worlds, ep_parity_reference, tmp_path_factory):
    """ep2 x efsdp2 on 4 ranks, saving the step-4 checkpoint the resume test continues from."""
    return run_ep_case(worlds, "ep2xdp2", tmp_path_factory.mktemp("ep2xdp2"))


@pytest.mark.parametrize("case", [c for c in EP_CASES if c != "ep2xdp2"] + ["ep2xdp2"])
def test_expert_parallel_matches_single_process(case, ep_parity_reference, tmp_path, worlds, request):
    got = request.getfixturevalue("ep2xdp2_run") if case == "ep2xdp2" else run_ep_case(worlds, case, tmp_path)
    sequence_aux = SEQUENCE_AUX[0] in EP_CASES[case]
    check_ep_case(case, request.getfixturevalue("sequence_aux_reference") if sequence_aux else ep_parity_reference, got)
    if case == "ep2":  # once: the reference's routing changes over the steps, and the bias moves
        assert routing_changed(ep_parity_reference) > 0.05
        bias = load_dumps(ep_parity_reference / "dump")[DUMP_STEPS[-1]]["params"]["layers.0.moe.expert_bias"]
        assert bias.abs().max() > 0


@pytest.mark.parametrize(
    "layout",
    [
        ["cluster.devices=4", "parallel.ep=4"],
        ["cluster.devices=1"],
        ["cluster.devices=4", "parallel.tp=2", "parallel.ep=2"],
    ],
    ids=["ep4", "one", "ep2xtp2"],
)
def test_resume_from_ep2xdp2_under_another_ep(layout, ep2xdp2_run, ep_parity_reference, tmp_path, worlds):
    """Saved under ep2 x efsdp2 at step 4, resumed under ep4, under one process and under ep2 x tp2 (experts
    split over ep x tp; DCP reshards the experts): steps 4-7 have the uninterrupted run's losses, gradients,
    weights and expert bias."""
    checkpoint = ep2xdp2_run / "checkpoints" / f"step-{RESUME_STEP:06d}"
    assert checkpoint.is_dir()
    got = run_layout(worlds, [*MOE, *layout, f"resume={checkpoint}"], tmp_path, steps=DUMP_STEPS[1:])
    check_ep_case(f"resume_{layout[-1]}", ep_parity_reference, got)


def test_global_aux_loss_under_accumulation_needs_the_step_counts(ep_parity_reference, tmp_path, worlds):
    """``ep2_accum2_global_step`` without ``model.moe.aux_loss_counts=step`` (nor checkpointing): each micro-step
    counts only its own tokens over the batch group, which is not one process on the whole batch (docs/moe.md,
    "precisely"); parity fails by at least 10x the tolerance."""
    case = "ep2_accum2_global_micro_batch"
    overrides = ["cluster.devices=2", "parallel.ep=2", "data.micro_batch_size=2"]
    report = measure(case, ep_parity_reference, run_layout(worlds, [*MOE, *overrides], tmp_path))
    ratio, what = report.margin(TOL)
    print(f"{case}: off by {ratio:.3g}x the tolerance ({what})")
    assert ratio >= 10, f"{case}: within {ratio:.3g}x of one process: the step counts would prove nothing ({what})"


def test_pipeline_aux_loss_mutant_is_caught_with_a_10x_margin(sequence_aux_reference, tmp_path, worlds):
    """The MoE layers' auxiliary loss back-propagated without the pipeline's loss scale (``pp_aux_loss_unscaled``,
    tests/support/mutants/) fails the interleaved pp2 case by at least 10x the tolerance."""
    case = "pp2_Interleaved1F1B_accum2"
    report = measure(case, sequence_aux_reference, run_ep_case(worlds, case, tmp_path, mutant="pp_aux_loss_unscaled"))
    ratio, what = report.margin(TOL)
    print(f"pp_aux_loss_unscaled: caught at {ratio:.3g}x ({what})")
    assert ratio >= 10, f"pp_aux_loss_unscaled caught at {ratio:.3g}x only ({what})"
