"""model.parallel_block: the GPT-J/PaLM block, its halved TP collectives, parity under dp2 x tp2, pp2 and cp2.

Parity is with one process of the same seed and global batch (reused gloo worlds, tests/support/world.py).
"""

import pytest
import torch

from helpers import TINY, losses
from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError
from lit_titan.models.llama3 import Transformer, get_flavor
from parity import TOL, check_case, run_layout


def _tiny(parallel_block: bool) -> Transformer:
    args = get_flavor(
        "llama3_debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, parallel_block=parallel_block
    )
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def test_parallel_block_is_x_plus_attn_plus_mlp_of_one_norm():
    model = _tiny(True)
    block = model.layers["0"]
    assert not hasattr(block, "ffn_norm")  # one norm per block
    x = torch.randn(2, 8, 64)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    n = block.attention_norm(x)
    want = x + (block.attention(n, cos, sin) + block.feed_forward(n))
    torch.testing.assert_close(block(x, cos, sin), want, rtol=0, atol=0)
    # and it is not the sequential block with the same weights
    seq = _tiny(False)
    assert (seq.layers["0"](x, cos, sin) - want).abs().max() > 1e-4


def test_parallel_block_names_a_subset_of_the_sequential_weights():
    seq = dict(_tiny(False).named_parameters())
    par = dict(_tiny(True).named_parameters())
    assert set(seq) - set(par) == {f"layers.{i}.ffn_norm.weight" for i in range(2)} and set(par) < set(seq)


def test_hf_init_refused_with_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        validate(compose([*TINY, "model.parallel_block=true", f"model.init_from_hf={tmp_path}"]))
    msg = str(info.value)
    assert "model.parallel_block=true has no Hugging Face Llama equivalent" in msg and "\n" not in msg


@pytest.mark.slow
def test_tp_collectives_per_block_halve(worlds):
    """One block under TP2 + SP: forward all-gather + reduce-scatter once instead of twice (backward too)."""
    got = worlds.run(2, "scripts.count_tp_collectives:main", None, timeout=300).value
    seq, par = got["sequential"], got["parallel"]
    for form in (seq, par):  # the TP block computes what the block computes on one rank
        assert form["max_diff"] < 1e-5, got
    assert seq["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, got
    assert par["forward"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, got
    seq_act = sum(v for k, v in seq["backward"].items() if k != "all_reduce")
    par_act = sum(v for k, v in par["backward"].items() if k != "all_reduce")
    assert par_act * 2 == seq_act > 0, got


# Parity (tests/support/parity.py): pre-clip gradients, clip norm, weights and losses equal a one-process run of the
# parallel block with the same seed and global batch, in parity.PARITY's regime (lr 1e-2, clipping engaged).
PARALLEL = ["model.parallel_block=true"]
LAYOUTS = {
    "pp2": ["cluster.devices=2", "parallel.pp=2"],
    "cp2": ["cluster.devices=2", "parallel.cp=2"],
    # TP with accumulation, compile (per block) and selective activation checkpointing around the
    # fork/join DTensors of the parallel block's TP plan, in one run. aot_eager: dynamo +
    # AOTAutograd trace the same graphs; this case cost ~4 s with it, 20-30 s with inductor on a
    # cold cache (CI), and inductor's own trap is guarded by test_callbacks.py's compile x TP x
    # FSDP test
    "dp2_tp2_accum2_compile_ac": [
        "cluster.devices=4",
        "parallel.tp=2",
        "data.micro_batch_size=2",
        "callbacks=[compile,activation_checkpointing]",
        "callbacks.compile.backend=aot_eager",
    ],
}


@pytest.mark.parity
@pytest.mark.slow
def test_parallel_block_matches_single_process(parity_reference, tmp_path, worlds):
    """One reference for the file's layouts (one test: a parallel-block reference shared by its cases)."""
    ref = run_layout(worlds, [*PARALLEL, "cluster.devices=1"], tmp_path / "one")
    # the setting reaches the model: the sequential block (the session's reference, same config but the
    # block) trains to other losses, far beyond the parity bound
    sequential = losses(parity_reference)
    assert max(abs(a - b) / a for a, b in zip(losses(ref), sequential)) > 100 * TOL.loss
    for name, layout in LAYOUTS.items():
        check_case(f"parallel_block_{name}", ref, run_layout(worlds, [*PARALLEL, *layout], tmp_path / name))


def test_planner_tp_comm_halves_and_one_norm_fewer():
    from lit_titan.cli.plan import make_plan

    base = [
        "model=llama3_8b",
        "cluster=h100_8",
        "parallel.tp=8",
        "data.seq_len=8192",
        "data.global_batch_size=8",
        "data.micro_batch_size=1",
    ]
    seq, par = (make_plan([*base, f"model.parallel_block={v}"], write=False) for v in ("false", "true"))
    assert seq["perf"]["tp_comm_s"] > 0
    assert par["perf"]["tp_comm_s"] == pytest.approx(seq["perf"]["tp_comm_s"] / 2, rel=1e-12)
    assert seq["params_total"] - par["params_total"] == 32 * 4096  # 32 blocks lose ffn_norm
