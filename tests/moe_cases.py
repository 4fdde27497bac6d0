"""Shared by tests/test_qwen3_moe.py and the cases it runs in the reused gloo worlds (tests/world.py).

Kept apart from the test module so the worlds' ranks do not import transformers.
"""

from __future__ import annotations

import torch

from lit_titan.models.qwen3_moe import Qwen3MoE, get_flavor

RTOL = 1e-5
VOCAB, SEQ, BATCH = 512, 32, 2


def tiny_args(**moe):
    # 3 layers, the middle one dense (HF's mlp_only_layers); head_dim apart from dim // n_heads as in Qwen3
    return get_flavor("qwen3_moe_debug", dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=VOCAB,
                      ffn_dim=96, max_seq_len=128, mlp_only_layers=[1],
                      moe={**dict(num_experts=8, top_k=2, hidden_dim=32, aux_loss_coef=0.05), **moe})


def build(args, dtype=torch.float64, seed=0) -> Qwen3MoE:
    with torch.device("meta"):
        model = Qwen3MoE(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.to(dtype)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # HF shifts labels inside; ours takes next-token labels, the last position ignored
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], 1)
    return tokens, labels


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def ep_gradient_case() -> float:
    """On each rank of a gloo world: ep = world size, each rank one row of the batch; returns the worst
    per-parameter relative gradient error (over ranks) against one process on the whole batch."""
    import torch.distributed as dist

    from lit_titan.strategies.expert_parallel import apply_expert_parallel, reduce_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    args = tiny_args(aux_loss="global")  # the global-batch loss: its counts summed over the data ranks
    tokens, labels = make_batch()
    reference = build(args)
    reference(tokens, labels=labels).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ours = build(args)
    for m in ours.moe_layers():
        m.count_group = dist.group.WORLD
    apply_expert_parallel(ours, dist.group.WORLD)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ours(tokens[rows], labels=labels[rows]).backward()
    reduce_gradients(ours, dist.group.WORLD, None)  # pure ep: no two ranks hold the same experts
    local = args.moe.num_experts // world
    worst = 0.0
    for name, p in ours.named_parameters():
        ref = ref_grads[name]
        if ".moe.experts." in name:
            assert p.shape[0] == local
            ref = ref[rank * local:(rank + 1) * local]
        worst = max(worst, rel_err(p.grad, ref))
    worst_t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    return worst_t.item()
