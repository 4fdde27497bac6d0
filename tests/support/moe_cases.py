"""Shared by tests/unit/models/test_qwen3_moe.py and the cases it runs in the reused gloo worlds (tests/support/world.py).

Kept apart from the test module so the worlds' ranks do not import transformers.
"""

from __future__ import annotations

import torch

from lit_titan.models.qwen3_moe import Qwen3MoE, get_flavor

RTOL = 1e-5
VOCAB, SEQ, BATCH = 512, 32, 2


def tiny_args(**moe):
    # 3 layers, the middle one dense (HF's mlp_only_layers); head_dim apart from dim // n_heads as in Qwen3
    return get_flavor(
        "qwen3_moe_debug",
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        ffn_dim=96,
        max_seq_len=128,
        mlp_only_layers=[1],
        moe={**dict(num_experts=8, top_k=2, hidden_dim=32, aux_loss_coef=0.05), **moe},
    )


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


def ep_gradient_case(steps: int = 3) -> dict[str, float]:
    """On each rank of a gloo world: ep = world size, each rank its rows of the batch, ``steps`` SGD steps
    with both balancing methods on (the global-batch aux loss and the expert bias). Returns the worst
    per-parameter relative gradient error and expert-bias difference (over ranks and steps) against
    one process on the whole batch, and the share of routing choices that changed over the steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_titan.models.moe import update_expert_bias
    from lit_titan.strategies.expert_parallel import apply_expert_parallel, reduce_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    # the global-batch loss (counts summed over the data ranks) and the aux-loss-free bias, both on
    args = tiny_args(aux_loss="global", bias_update_rate=0.01)
    reference, ours = build(args), build(args)
    for m in ours.moe_layers():
        m.count_group = dist.group.WORLD
    apply_expert_parallel(ours, init_device_mesh("cpu", (world,)))
    local = args.moe.num_experts // world
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    routes = []
    reference.layers["0"].moe.router.register_forward_hook(lambda mod, inp, out: routes.append(out[2]))
    worst = {"grad": 0.0, "bias": 0.0}
    tokens, labels = make_batch()
    for _ in range(steps):
        reference(tokens, labels=labels).backward()
        ours(tokens[rows], labels=labels[rows]).backward()
        reduce_gradients(ours, dist.group.WORLD, None)  # pure ep: no two ranks hold the same experts
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for name, p in ours.named_parameters():
            ref = ref_grads[name]
            grad = p.grad
            if ".moe.experts." in name:
                grad = grad.to_local()
                assert grad.shape[0] == local
                ref = ref[rank * local : (rank + 1) * local]
            worst["grad"] = max(worst["grad"], rel_err(grad, ref))
        for model, optimizer, group in ((reference, opt_ref, None), (ours, opt, dist.group.WORLD)):
            optimizer.step()
            optimizer.zero_grad()
            update_expert_bias(model, group)
        for a, b in zip(reference.moe_layers(), ours.moe_layers()):
            worst["bias"] = max(worst["bias"], (a.expert_bias - b.expert_bias).abs().max().item())
    assert any(m.expert_bias.abs().sum() > 0 for m in ours.moe_layers())
    result = torch.tensor([worst["grad"], worst["bias"]], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return {
        "grad": result[0].item(),
        "bias": result[1].item(),
        "routing_changed": (routes[0] != routes[-1]).any(-1).float().mean().item(),
    }
