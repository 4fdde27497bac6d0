"""Qwen3-MoE and the MoE layer, checked against an implementation that is not ours: transformers'
``Qwen3MoeForCausalLM`` on the same weights, loaded through ``from_pretrained`` from a directory our
adapter wrote (so names, expert stacking and config are checked as well).

Tolerance: transformers computes RMSNorm (and so the q/k norms), the attention and router softmaxes, the
load-balancing sums and its loss in fp32 even in an fp64 model; in the fp64 comparison they run in the input's
dtype (``tests/support/hf_input_dtype.py``, a test-side shim, checked here to give transformers' own numbers in
fp32). The worst errors measured then: 8.4e-16 (gradients), 3.5e-16 (logits), 0 (loss, aux loss); ``HF_RTOL`` =
1e-14 sits about 10x above them and far below what a wrong routing weight, aux-loss term or renormalisation moves
(1e-3 or more). fp32 comparisons keep ``RTOL`` = 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3MoeForCausalLM

from hf_input_dtype import in_input_dtype
from lit_titan.models.moe import MoE, MoEArgs, grouped_mm_works, moe_aux_loss, update_expert_bias
from lit_titan.models.qwen3_moe import Qwen3MoE, count_params, flops_per_token, get_flavor, hf
from moe_cases import RTOL, build, make_batch, rel_err, tiny_args

HF_RTOL = 1e-14


def _reference(model: Qwen3MoE, tmp_path, dtype=torch.float64) -> Qwen3MoeForCausalLM:
    hf.save_hf(model.state_dict(), model.args, tmp_path, dtype=dtype)
    # eager: its per-expert loop, an implementation independent of our sorting and grouped GEMM
    ref = Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    return ref.train()


def _hf_grads_as_ours(ref: Qwen3MoeForCausalLM, hidden: int) -> dict[str, torch.Tensor]:
    """transformers (>= 5) fuses gate and up in memory (``gate_up_proj`` [E, 2h, d], gate first)."""
    out = {}
    for name, p in ref.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            layer = name.split(".")[2]
            out[f"layers.{layer}.moe.experts.w1"], out[f"layers.{layer}.moe.experts.w3"] = p.grad.split(hidden, 1)
        elif name.endswith("experts.down_proj"):
            out[f"layers.{name.split('.')[2]}.moe.experts.w2"] = p.grad
        else:
            out.update({k: p.grad for k in hf.from_hf_state_dict({name: p}, tiny_args())})
    return out


def test_logits_loss_aux_loss_and_gradients_equal_transformers(tmp_path, monkeypatch):
    """One fp64 training step: logits, loss (CE + coef * HF's load-balancing loss) and every parameter's gradient."""
    in_input_dtype(monkeypatch)
    args = tiny_args()
    ours = build(args)
    ref = _reference(ours, tmp_path)
    tokens, labels = make_batch()
    out = ref(input_ids=tokens, labels=tokens)
    assert out.aux_loss is not None  # output_router_logits comes from our config
    loss = ours(tokens, labels=labels)
    assert rel_err(ours(tokens), out.logits) < HF_RTOL
    assert abs(loss.item() - out.loss.item()) < HF_RTOL * out.loss.item()
    assert abs(ours.last_aux_loss.item() / (args.moe.aux_loss_coef * out.aux_loss.item()) - 1) < HF_RTOL
    loss.backward()
    out.loss.backward()
    theirs = _hf_grads_as_ours(ref, args.moe.hidden_dim)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert set(grads) == set(theirs)
    errors = {n: rel_err(grads[n], theirs[n]) for n in grads}
    assert max(errors.values()) < HF_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    # the router's gradient is where the aux loss shows: without it the router gradient is another one
    no_aux = build(tiny_args(aux_loss="none"))
    no_aux(tokens, labels=labels).backward()
    router = "layers.0.moe.router.gate.weight"
    assert rel_err(dict(no_aux.named_parameters())[router].grad, theirs[router]) > 100 * RTOL


def test_the_shim_gives_transformers_own_numbers_in_fp32(tmp_path, monkeypatch):
    """The shim changes only the dtype: in fp32 transformers' loss, aux loss and gradients are bitwise the same."""
    model = build(tiny_args(), torch.float32)
    tokens, _ = make_batch()

    def step() -> list[torch.Tensor]:
        ref = _reference(model, tmp_path, torch.float32)
        out = ref(input_ids=tokens, labels=tokens)
        out.loss.backward()
        return [out.loss, out.aux_loss, *(p.grad for p in ref.parameters())]

    plain = step()
    in_input_dtype(monkeypatch)
    shimmed = step()
    assert all(torch.equal(a, b) for a, b in zip(plain, shimmed, strict=True))


def test_fp32_grouped_experts_equal_transformers_and_the_loop(tmp_path):
    """fp32 logits through ``torch._grouped_mm`` (where this torch runs it on CPU) against HF; the loop equals it."""
    args = tiny_args()
    ours = build(args, torch.float32)
    ref = _reference(ours, tmp_path, torch.float32)
    tokens, _ = make_batch(1)
    moe = ours.layers["0"].moe
    x = torch.randn(4, 8, args.dim)
    assert moe.experts.use_grouped(x) == grouped_mm_works("cpu", torch.float32)
    assert not moe.experts.use_grouped(x.double())  # CPU grouped_mm has no fp64: the loop
    with torch.no_grad():
        grouped = ours(tokens)
        assert rel_err(grouped, ref(input_ids=tokens).logits) < RTOL
        for m in ours.moe_layers():
            m.experts.impl = "loop"
        assert rel_err(ours(tokens), grouped) < RTOL


def test_routing_is_dropless_deterministic_and_counts_once():
    """Ties -> lowest expert index; no token dropped however skewed; sigmoid/shared/bias options run;
    the bias moves toward balance; a forward recomputed by activation checkpointing is not counted twice."""
    torch.manual_seed(0)
    moe = MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, experts_impl="loop"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    torch.nn.init.zeros_(moe.router.gate.weight)  # every score equal: a tie everywhere
    x = torch.randn(3, 5, 16)
    _, _, idx = moe.router(x.reshape(-1, 16))
    assert idx.tolist() == [[0, 1]] * 15
    # skewed router: all tokens prefer expert 3; dropless means each still gets exactly top_k experts
    with torch.no_grad():
        moe.router.gate.weight[3] = 10.0
    y = moe(x.abs())
    assert moe.stats == {} and y.shape == x.shape  # aux_loss_coef 0: no statistics kept
    counts = torch.bincount(moe.router(x.abs().reshape(-1, 16))[2].reshape(-1), minlength=4)
    assert counts.sum() == 15 * 2 and counts[3] == 15
    dsv3 = MoE(
        16,
        MoEArgs(
            num_experts=4,
            top_k=2,
            hidden_dim=8,
            score_func="sigmoid",
            num_shared_experts=1,
            route_scale=2.5,
            bias_update_rate=0.1,
            aux_loss="sequence",
            aux_loss_coef=0.01,
        ),
    )
    for p in dsv3.parameters():
        torch.nn.init.normal_(p, std=0.1)
    dsv3.train()
    _, w, _ = dsv3.router(x.reshape(-1, 16))
    assert torch.allclose(w.sum(-1), torch.full((15,), 2.5))  # renormalised, then scaled
    out = checkpoint(dsv3, x, use_reentrant=False)
    (out.sum() + moe_aux_loss([dsv3])).backward()  # recomputes dsv3's forward inside backward
    assert dsv3.tokens_per_expert.sum().item() == 15 * 2
    counts = dsv3.tokens_per_expert.clone()
    update_expert_bias(dsv3)
    assert torch.equal(dsv3.expert_bias, 0.1 * torch.sign(counts.mean() - counts))
    assert dsv3.tokens_per_expert.sum() == 0 and "expert_bias" in dsv3.state_dict()


def test_balancing_losses_follow_their_formulas():
    """pooled (HF's) for one layer equals global for one process; sequence-wise equals DeepSeek-V3's formula."""
    torch.manual_seed(1)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    layers = {}
    for kind in ("pooled", "global", "sequence"):
        torch.manual_seed(2)
        layers[kind] = MoE(
            16, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, aux_loss=kind, aux_loss_coef=1.0, experts_impl="loop")
        ).double()
        torch.nn.init.normal_(layers[kind].router.gate.weight)
        layers[kind](x)
    assert torch.allclose(moe_aux_loss([layers["pooled"]]), moe_aux_loss([layers["global"]]))
    scores, _, idx = layers["sequence"].router(x.reshape(-1, 16))
    scores, idx = scores.view(2, 6, 4), idx.view(2, 6, 2)
    expected = 0.0
    for b in range(2):
        f = torch.stack([(idx[b] == i).sum() for i in range(4)]) * 4 / (2 * 6)
        expected += (f * (scores[b] / scores[b].sum(-1, keepdim=True)).mean(0)).sum() / 2
    assert torch.allclose(moe_aux_loss([layers["sequence"]]), expected)


def test_flavors_have_the_published_shapes_and_count_active_flops():
    """config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B; 30.5B/3.3B and 235B/22B parameters."""
    published = {
        "qwen3_30b_a3b": dict(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            max_position_embeddings=40960,
        ),
        "qwen3_235b_a22b": dict(
            hidden_size=4096,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            max_position_embeddings=40960,
        ),
    }
    common = dict(
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    )
    for name, shape in published.items():
        config = hf.hf_config(get_flavor(name))
        assert {k: config[k] for k in {**shape, **common}} == {**shape, **common}, name
    a30, a235 = get_flavor("qwen3_30b_a3b"), get_flavor("qwen3_235b_a22b")
    assert round(count_params(a30) / 1e9, 1) == 30.5 and round(count_params(a30, active=True) / 1e9, 1) == 3.4
    assert round(count_params(a235) / 1e9) == 235 and round(count_params(a235, active=True) / 1e9) == 22
    # 6 x active non-embedding params + attention; far below the total-parameter count
    assert flops_per_token(a30, 4096) < 6 * count_params(a30) / 5
    tiny = tiny_args()
    sd = build(tiny).state_dict()
    back = hf.from_hf_state_dict(hf.to_hf_state_dict(sd, tiny), tiny)
    assert set(back) == set(sd)  # the expert bias is a buffer only with bias_update_rate > 0
    assert all(torch.equal(back[k], sd[k]) for k in back)
    with pytest.raises(ValueError, match="top_k=9"):
        tiny_args(top_k=9)


def test_expert_parallel_ep2_gradients_equal_one_process(worlds):
    """ep2 on gloo, three steps: dispatch/combine by all-to-all, the global-batch aux loss and the expert
    bias over both ranks, expert gradients divided by the data-parallel size (not by the
    expert-data-parallel group's: that would make them 2x too large, an error of 1.0 here)."""
    result = worlds.run(2, "moe_cases:ep_gradient_case").value
    assert result["grad"] < RTOL and result["bias"] == 0.0, result
    assert result["routing_changed"] > 0.05, result  # the steps moved tokens to other experts
