"""The Qwen3-MoE family under TitanStrategy equals one process: gradients, clip norm, weights, expert bias, losses.

tests/support/moe_parity.py's regime (the sequence-wise auxiliary loss and the expert bias both on) on the
parity harness: per-parameter pre-clip gradients, the clipped norm, the weights and the expert bias after
steps 0, 4 and 7, each step's loss and auxiliary loss, against one shared one-process reference.
"""

import pytest

from helpers import read_metrics
from moe_parity import MOE_CASES, run_moe_case
from parity import check_case

pytestmark = pytest.mark.slow


def aux_losses(run_dir) -> list[float]:
    return [float(r["train/aux_loss"]) for r in read_metrics(run_dir) if r.get("train/aux_loss")]


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_layout_matches_single_process(case, moe_parity_reference, tmp_path, worlds):
    got = run_moe_case(worlds, case, tmp_path)
    check_case(case, moe_parity_reference, got)
    ref_aux, got_aux = aux_losses(moe_parity_reference), aux_losses(got)
    assert len(ref_aux) == len(got_aux) == 8 and len(set(ref_aux)) > 1, (ref_aux, got_aux)
    assert max(abs(g - r) / r for g, r in zip(got_aux, ref_aux)) < 1e-5, (ref_aux, got_aux)


TIE_TOL = 1e-9  # fp64: the measured error without a bug is ~1e-16


def test_routing_ties_break_alike_on_every_rank(worlds):
    """Every score tied (router weights zero): dp2 gradients equal one process, so ties go to the same
    experts on every rank (the lowest index), not in an order that depends on the device or rank."""
    assert worlds.run(2, "moe_tie_case:dp_ties_error").value < TIE_TOL


def test_moe_reference_routing_changes_over_the_steps(moe_parity_reference):
    """The compared steps are not one routing: between steps 0 and 7 the router's weights and the expert bias
    send a share of the same inputs to other experts, and the bias has moved (the aux-loss-free method ran)."""
    import torch

    from moe_parity import MOE
    from parity import load_dumps

    dumps = load_dumps(moe_parity_reference / "dump")
    first, last = dumps[min(dumps)]["params"], dumps[max(dumps)]["params"]
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0), dtype=first["tok_embeddings.weight"].dtype)
    k = int(next(o for o in MOE if o.startswith("model.moe.top_k=")).split("=")[1])
    changed = []
    for layer in ("0", "1"):
        gate, bias = f"layers.{layer}.moe.router.gate.weight", f"layers.{layer}.moe.expert_bias"
        assert last[bias].abs().max() > 0, "the expert bias never moved"
        before = torch.topk((x @ first[gate].T).softmax(-1) + first[bias], k).indices.sort(-1).values
        after = torch.topk((x @ last[gate].T).softmax(-1) + last[bias], k).indices.sort(-1).values
        changed.append((before != after).any(-1).float().mean().item())
    assert min(changed) > 0.05, changed


@pytest.mark.parity
def test_global_batch_aux_loss_dp2_matches_single_process(tmp_path, worlds):
    """Qwen's global-batch balancing loss (``aux_loss=global``): each rank's token counts summed over the data
    ranks (the module sets ``count_group`` to the strategy's batch group), so dp2 has one process's loss,
    gradients and weights. Without accumulation: its counts are each micro-batch's (docs/moe.md)."""
    from moe_parity import MOE
    from parity import run_layout

    regime = [o for o in MOE if not o.startswith("model.moe.aux_loss=")] + ["model.moe.aux_loss=global"]
    reference = run_layout(worlds, [*regime, "cluster.devices=1"], tmp_path / "reference")
    got = run_layout(worlds, [*regime, "cluster.devices=2"], tmp_path / "dp2")
    check_case("moe_global_dp2", reference, got)
    ref_aux, got_aux = aux_losses(reference), aux_losses(got)
    assert len(got_aux) == 8 and max(abs(g - r) / r for g, r in zip(got_aux, ref_aux)) < 1e-5, (ref_aux, got_aux)
