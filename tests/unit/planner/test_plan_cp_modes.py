"""The planner and MFU per context-parallel mode (parallel.cp_mode): closed forms, the plan's line, the search.

Closed forms are written out here from the shapes (not read from lit_titan/planner/cp_modes.py), so a change
of the model shows as a failure; docs/planner.md ("Context parallel modes") states the same formulas.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_titan.planner import cp_modes, estimate
from lit_titan.strategies.parallel_dims import ParallelDims


def _args(n_heads=32, n_kv_heads=8, head_dim=128, window=None):
    """The attention shapes the formulas read (Llama 3 8B's by default), with a sliding window or not."""
    return SimpleNamespace(
        n_heads=n_heads,
        kv_heads=n_kv_heads,
        head_dim=head_dim,
        dim=n_heads * head_dim,
        ffn_hidden_dim=14336,
        vocab_size=128256,
        n_layers=2,
        window_of=lambda layer: window,
    )


def test_memory_and_communication_per_mode_in_closed_form():
    a = _args()
    s, b, t, cp = 65536, 1, 2, 4
    h, h_kv = 32 * 128, 8 * 128
    local_kv = s * b / (t * cp) * 2 * h_kv  # elements of the rank's own K and V
    # kept for backward beyond the local slice (16-bit count): all-gather keeps the rest of the sequence's K/V
    assert cp_modes.kept_kv_bytes(a, s, b, t, cp, "allgather") == 2 * s * b * 2 * h_kv / t * (1 - 1 / cp)
    assert cp_modes.kept_kv_bytes(a, s, b, t, cp, "ulysses") == 0 == cp_modes.kept_kv_bytes(a, s, b, t, cp, "ring")
    assert cp_modes.kept_kv_bytes(a, s, b, t, 1, "allgather") == 0
    # ring's backward transient: the block in flight (bf16) + two fp32 K/V gradient accumulators + one chunk
    # pair's fp32 scores (3 tensors of [b, heads/t, chunk, chunk], the shipped kernel)
    chunk = s / (2 * cp)
    scores = 3 * b * 32 / t * chunk * chunk * 4
    assert cp_modes.backward_transient_bytes(a, s, b, t, cp, "ring", 2) == local_kv * 2 + 2 * local_kv * 4 + scores
    assert cp_modes.backward_transient_bytes(a, s, b, t, cp, "allgather", 2) == 0
    # bytes sent per block, forward + backward
    allgather = cp_modes.comm_bytes_per_block(a, s, b, t, cp, "allgather")
    ulysses = cp_modes.comm_bytes_per_block(a, s, b, t, cp, "ulysses")
    ring = cp_modes.comm_bytes_per_block(a, s, b, t, cp, "ring")
    assert allgather == 2 * (3 / 4) * (s * b * 2 * h_kv / t) * 2  # all-gather K/V + reduce-scatter of dK/dV
    assert ulysses == 8 * (3 / 4) * (s * b / cp) * ((h + h + h_kv + h_kv) / 4) / t * 2  # 4 all-to-alls each way
    assert ring == (cp - 1) * 2 * local_kv * 2 + cp * local_kv * 4  # blocks twice round, fp32 gradients once
    # Ulysses' all-to-alls carry (h + h_kv) / (cp h_kv) of all-gather's bytes: 5/4 for 8B at cp4, less at cp8
    assert ulysses / allgather == pytest.approx((h + h_kv) / (cp * h_kv))
    assert cp_modes.OVERLAPPED == {"allgather": False, "ulysses": False, "ring": True}


def test_ulysses_offered_only_where_heads_divide():
    a = _args(n_heads=32, n_kv_heads=4)
    assert cp_modes.modes_for(a, tp=1, cp=4) == ("allgather", "ulysses", "ring")
    assert cp_modes.modes_for(a, tp=2, cp=4) == ("allgather", "ring")  # 4 KV heads over tp x cp = 8
    assert cp_modes.modes_for(a, tp=8, cp=1) == ("allgather",)


def test_activation_estimate_and_step_follow_the_mode_but_model_flops_do_not():
    """What each mode changes in rank_memory's activations and in step_time, and what it must not: the model
    FLOPs (MFU's numerator) and the compute term are the model's, whatever the kernel skips or recomputes."""
    a = _args()
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=2, world_size=8)
    s = 65536
    common = dict(
        seq_len=s,
        micro_batch=1,
        mode="none",
        every_n_layers=2,
        layers_on_rank=2,
        has_output=False,
        pp_microbatches=1,
        stages_per_rank=1,
        act_elem=2,
    )
    acts = {m: estimate.activation_bytes(a, dims, **common, cp_mode=m) for m in ("allgather", "ulysses", "ring")}
    kept = cp_modes.kept_kv_bytes(a, s, 1, 2, 4, "allgather")
    assert acts["allgather"]["blocks"] - acts["ulysses"]["blocks"] == pytest.approx(2 * kept, abs=2)
    assert acts["ring"]["blocks"] == acts["ulysses"]["blocks"]
    assert acts["ring"]["recompute_peak"] - acts["ulysses"]["recompute_peak"] == pytest.approx(
        cp_modes.backward_transient_bytes(a, s, 1, 2, 4, "ring", 2), abs=2
    )

    from lit_titan.planner.build import ShardedLayout

    layout = ShardedLayout(
        params_total=10**9,
        local_numel=10**8,
        local_param_bytes=4 * 10**8,
        param_dtype=None,
        fsdp_applied=False,
        layers_on_rank=2,
        stage_ids=[0],
        num_stages=1,
        unsharded_bf16_bytes=0,
        largest_unit_numel=0,
    )
    cluster = {"peak_bf16_tflops": 989, "intra_node_gbps": 450, "gpus_per_node": 8, "hbm_gbps": 3350}
    perf = {
        m: estimate.step_time(
            a,
            dims,
            cluster,
            layout,
            flops_per_token=1e10,
            seq_len=s,
            global_batch=1,
            micro_batch=1,
            pp_microbatches=1,
            stages_per_rank=1,
            ac_mode="none",
            reshard_after_forward=True,
            precision="bf16-mixed",
            cp_mode=m,
        )
        for m in ("allgather", "ulysses", "ring")
    }
    assert len({p["compute_s"] for p in perf.values()}) == 1
    for p in perf.values():  # MFU = the model's FLOPs (1e10 per token here) over the step, whatever the mode
        assert p["mfu_bound"] * p["step_s"] == pytest.approx(1e10 * s / 8 / 989e12, rel=1e-12)
    bw = 450e9 * estimate.COMM_EFFICIENCY
    for m in ("allgather", "ulysses"):  # exposed in full
        assert perf[m]["cp_comm_s"] == pytest.approx(2 * cp_modes.comm_bytes_per_block(a, s, 1, 2, 4, m) / bw)
    ring = perf["ring"]
    # ring: the transfers hide behind its fp32 attention; what it adds is that kernel's extra time
    kernel_flops = 2 * 12 * 32 / 2 * 128 * (s / 2) * s / 4
    fast, slow = 989e12 * 0.6, 989e12 / cp_modes.FP32_MATH_SLOWDOWN * 0.6
    assert ring["cp_kernel_s"] == pytest.approx(kernel_flops / slow - kernel_flops / fast)
    assert ring["cp_comm_s"] == pytest.approx(ring["cp_kernel_s"])  # nothing exposed of its transfers
    assert ring["cp_comm_total_s"] == pytest.approx(2 * cp_modes.comm_bytes_per_block(a, s, 1, 2, 4, "ring") / bw)


def test_plan_prints_the_mode():
    """The one-layout plan (a meta build over a fake process group) reports what the mode keeps and sends; on a
    26 GiB device Llama 3.2 1B at 128K tokens fits under Ulysses and not under all-gather (its K/V)."""
    from lit_titan.config import compose
    from lit_titan.planner.core import make_plan_from_cfg, render_table

    base = ["model=llama3_2_1b", "cluster=h100_8", "cluster.hbm_gib=26", "data.seq_len=131072"]
    layout = [
        "data.global_batch_size=1",
        "parallel.cp=8",
        "parallel.dp_shard=1",
        "callbacks=[activation_checkpointing]",
    ]
    plans = {
        m: make_plan_from_cfg(compose([*base, *layout, f"parallel.cp_mode={m}"])) for m in ("allgather", "ulysses")
    }
    ag, ul = plans["allgather"], plans["ulysses"]
    assert ag["flops_per_token"] == ul["flops_per_token"]
    assert ag["context_parallel"]["mode"] == "allgather" and ag["context_parallel"]["overlapped"] is False
    # 131072 tokens x 512 K/V width x 2 tensors x 2 bytes x 7/8: 224 MiB per block kept by all-gather alone
    assert ag["context_parallel"]["kept_kv_bytes_per_block"] == 224 * 2**20
    assert ul["context_parallel"]["kept_kv_bytes_per_block"] == 0
    # 16 blocks kept by selective checkpointing + the one a backward recomputes
    assert ag["per_rank"]["activation_bytes"] - ul["per_rank"]["activation_bytes"] == 17 * 224 * 2**20
    assert ag["fits"] is False and ul["fits"] is True
    line = next(x for x in render_table(ag).splitlines() if x.startswith("context parallel allgather:"))
    assert "224.0 MiB" in line and "exposed" in line


def test_search_picks_a_mode_that_fits_where_all_gather_does_not():
    """Llama 3 8B at 128K tokens on 8 H100s, one sequence per step: all-gather's full-sequence K/V (14 GiB over 32
    layers at cp8) does not fit without full activation checkpointing; the winner runs Ulysses (or ring) with
    selective checkpointing, and the same layout under all-gather is over the memory."""
    from lit_titan.config import compose
    from lit_titan.planner.search import search

    ov = ["model=llama3_8b", "cluster=h100_8", "data.seq_len=131072", "data.global_batch_size=1"]
    res = search(compose(ov), ov, confirm=0, top=200)
    win = res["winner"]
    assert win["cp_mode"] in ("ulysses", "ring") and win["mesh"]["cp"] > 1, win["layout"]
    assert f"parallel.cp_mode={win['cp_mode']}" in res["command"]
    assert res["fitting"] <= 200  # every fitting layout is in the table
    twins = [
        r
        for r in res["top"]
        if r["cp_mode"] == "allgather"
        and (r["mesh"], r["ac_mode"], r["micro_batch"]) == (win["mesh"], win["ac_mode"], win["micro_batch"])
    ]
    assert twins == []  # the same layout under all-gather does not fit
    modes = {r["cp_mode"] for r in res["top"] if r["mesh"]["cp"] > 1}
    assert modes == {"allgather", "ulysses", "ring"}, modes
