"""An MoE block recomputed by activation checkpointing trains as without it, and takes its counts once.

The first forward of a process probes ``torch._grouped_mm``; run inside a checkpointed block, the probe's
tensors were saved as the block's, the recomputed forward (no probe) saved 3 fewer and
``torch.utils.checkpoint`` raised. The expert-parallel case is ``test_expert_parallel.py``'s ``ep2_ac_full``.
"""

import torch

from lit_titan.models.init import canonical_name
from lit_titan.models.moe import _probe_grouped_mm
from lit_titan.strategies.transforms import apply_activation_checkpointing
from moe_cases import build, make_batch, rel_err, tiny_args


def _train(mode: str, steps: int = 2):
    """``steps`` SGD steps of the tiny model in fp32 (the grouped GEMM path); grads, aux losses and counts."""
    model = build(tiny_args(aux_loss="global", bias_update_rate=0.01), dtype=torch.float32)
    apply_activation_checkpointing(model, model.layers, mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens, labels = make_batch()
    out = {"grads": [], "aux": [], "counts": []}
    for _ in range(steps):
        loss = model(tokens, labels=labels)
        stats = [m.stats for m in model.moe_layers()]
        loss.backward()
        out["aux"].append(model.last_aux_loss)
        out["grads"].append({canonical_name(n): p.grad.clone() for n, p in model.named_parameters()})
        out["counts"].append(torch.stack([m.tokens_per_expert.clone() for m in model.moe_layers()]))
        # the recomputed forward left the forward's statistics (and ran no collective for them)
        assert all(a is b for a, b in zip(stats, [m.stats for m in model.moe_layers()]))
        optimizer.step()
        optimizer.zero_grad()
        for m in model.moe_layers():  # the bias moves by the counts (update_expert_bias without a group)
            m.expert_bias += m.args.bias_update_rate * torch.sign(m.tokens_per_expert.mean() - m.tokens_per_expert)
            m.tokens_per_expert.zero_()
    return out


def test_checkpointed_moe_blocks_equal_no_checkpointing():
    """One process, the global-batch aux loss and the expert bias on, full and per-op checkpointing: gradients,
    aux losses and the counts the bias moves by equal the run without; the first checkpointed forward probes."""
    reference = _train("none")
    tokens = make_batch()[0].numel() * tiny_args().moe.top_k
    for mode in ("full", "selective_op"):
        _probe_grouped_mm.cache_clear()  # as in a fresh process
        got = _train(mode)
        for step, (ref, ours) in enumerate(zip(reference["counts"], got["counts"])):
            assert torch.equal(ref, ours) and (ours.sum(1) == tokens).all(), (mode, step, ours)  # counted once
        for ref, ours in zip(reference["aux"], got["aux"]):
            assert rel_err(ours, ref) < 1e-6, mode
        for ref, ours in zip(reference["grads"], got["grads"]):
            worst = max(rel_err(ours[n], ref[n]) for n in ref)
            assert worst < 1e-6, (mode, worst)
