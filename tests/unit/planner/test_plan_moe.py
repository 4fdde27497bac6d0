"""The planner's expert-parallel terms (planner/moe.py, estimate.py) in closed form, and the search over ``ep``."""

from __future__ import annotations

import pytest

from lit_titan.config import compose
from lit_titan.config.spec import model_args
from lit_titan.errors import ConfigError
from lit_titan.planner import estimate, moe
from lit_titan.planner.analytic import analytic_layout
from lit_titan.strategies.parallel_dims import ParallelDims

H100_64 = ["model=qwen3_30b_a3b", "cluster=h100_64", "cluster.fp8=false", "data.seq_len=4096"]


def _step(args, cluster, dims, *, imbalance=1.0, ac="none", gbs=64):
    layout = analytic_layout(args, dims, None, precision="bf16-mixed")
    perf = estimate.step_time(
        args,
        dims,
        cluster,
        layout,
        flops_per_token=1e9,
        seq_len=4096,
        global_batch=gbs,
        micro_batch=1,
        pp_microbatches=1,
        stages_per_rank=1,
        ac_mode=ac,
        reshard_after_forward=True,
        precision="bf16-mixed",
        eff=estimate.DEFAULT_EFFICIENCIES.with_(expert_imbalance=imbalance),
    )
    return layout, perf


def test_expert_parallel_closed_forms():
    """Hand-computed Qwen3-30B-A3B numbers (dim 2048, 48 MoE layers of 128 experts, top 8, width 768)."""
    cfg = compose(H100_64)
    args, cluster = model_args(cfg), dict(cfg.cluster)
    h, k, e, w = 2048, 8, 128, 768
    assert len(moe.moe_layers(args)) == 48 and moe.routed_expert_numel(args, 0) == e * 3 * h * w
    # one all-to-all: tokens x top_k x dim x 2 bytes x (ep-1)/ep, times the ranks' imbalance (capped at ep)
    assert moe.all_to_all_bytes(args, tokens=4096, ep=8) == 4096 * k * h * 2 * 7 / 8
    assert moe.all_to_all_bytes(args, tokens=4096, ep=8, expert_imbalance=1.5) == 1.5 * 4096 * k * h * 2 * 7 / 8
    assert moe.all_to_all_bytes(args, tokens=4096, ep=1) == 0
    assert moe.rank_imbalance(3.0, 2) == 2 and moe.rank_imbalance(3.0, 1) == 1 and moe.rank_imbalance(0.5, 8) == 1
    assert moe.expert_flops_per_token(args) == 6 * 48 * k * 3 * h * w

    ep1, ep8 = ParallelDims(dp_shard=64, world_size=64), ParallelDims(dp_shard=64, world_size=64, ep=8)
    lay1, p1 = _step(args, cluster, ep1)
    lay8, p8 = _step(args, cluster, ep8)
    # memory: experts over ep x efsdp = dp_shard x cp either way (128 / 64 = 2 experts a rank); an expert FSDP
    # unit gathers over efsdp only, 1/8 of a layer's experts, so the largest unit shrinks and so does FSDP traffic
    assert lay1.local_numel == lay8.local_numel and lay8.expert_numel == 48 * 2 * 3 * h * w
    assert lay8.largest_unit_numel < lay1.largest_unit_numel
    assert p1["ep_comm_s"] == 0 and p8["fsdp_comm_s"] < p1["fsdp_comm_s"]
    # the all-to-all: 48 layers x 4 (dispatch + combine, forward + backward) over NVLink (ep 8 = one node)
    tokens = 64 * 4096 / 64
    bw = 450e9 * estimate.COMM_EFFICIENCY
    assert p8["ep_link"] == "nvlink"
    assert p8["ep_comm_s"] == pytest.approx(48 * 4 * tokens * k * h * 2 * 7 / 8 / bw, rel=1e-12)
    # full AC runs dispatch and combine again in backward: 6 instead of 4
    assert _step(args, cluster, ep8, ac="full")[1]["ep_comm_s"] == pytest.approx(p8["ep_comm_s"] * 6 / 4)
    # imbalance 1.5: the all-to-all x1.5, and the hottest rank's expert FLOPs half again
    _, hot = _step(args, cluster, ep8, imbalance=1.5)
    assert hot["ep_comm_s"] == pytest.approx(1.5 * p8["ep_comm_s"])
    extra = moe.expert_flops_per_token(args) * 64 * 4096 / 64 * 0.5 / (989e12 * estimate.COMPUTE_EFFICIENCY)
    assert hot["compute_s"] - p8["compute_s"] == pytest.approx(extra, rel=1e-9)
    # without EP no rank waits for another's experts: the imbalance changes nothing
    assert _step(args, cluster, ep1, imbalance=1.5)[1]["step_s"] == p1["step_s"]
    # a dense model has no MoE term
    dense = model_args(compose(["model=llama3_8b"]))
    assert moe.expert_flops_per_token(dense) == 0 and moe.routed_activation_bytes_per_token(dense) == 0
    # the planner key: a ratio below 1 is one line before any work
    with pytest.raises(ConfigError, match=r"^plan\.expert_imbalance=0\.5: not a max/mean ratio"):
        estimate.with_expert_imbalance(None, "0.5")
    assert estimate.with_expert_imbalance(None, "1.3").expert_imbalance == 1.3


def test_search_proposes_expert_parallel_for_qwen3_30b():
    """`plan search=true` over ep: Qwen3-30B-A3B on 2 nodes of 8 H100s with a small batch, where gathering
    every expert per micro-batch cannot hide behind compute: an ep > 1 layout wins, confirmed by
    the real build, and its command names parallel.ep. Layouts the rules refuse (ep with selective_op
    activation checkpointing) are not proposed."""
    from lit_titan.planner.search import search

    overrides = [*H100_64, "cluster.num_nodes=2", "data.global_batch_size=32"]
    res = search(compose(overrides), overrides, confirm=1)
    win = res["winner"]
    ep = int(next(o for o in win["overrides"] if o.startswith("parallel.ep=")).split("=")[1])
    assert ep > 1, win["layout"]
    assert (
        win["confirmed"]["fits"] and win["confirmed"]["param_bytes_built"] == win["confirmed"]["param_bytes_analytic"]
    )
    assert f"parallel.ep={ep}" in res["command"]
    assert all(r["ac_mode"] != "selective_op" for r in res["top"] if " ep1 " not in r["layout"])
