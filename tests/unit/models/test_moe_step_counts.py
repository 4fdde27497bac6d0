"""``model.moe.aux_loss_counts=step``: the global-batch auxiliary loss under accumulation equals one forward of the
whole batch, because a counting forward takes the step's tokens per expert before the first backward.

One process, fp64, no process group (the expert-parallel case with accumulation is ``test_expert_parallel.py``'s
``ep2_accum2_global_step``). Every block is recomputed in backward (full activation checkpointing): its
forward must not count again.
"""

import torch

from lit_titan.models.init import canonical_name
from lit_titan.models.moe import count_step_tokens, forget_step_counts
from lit_titan.strategies.transforms import apply_activation_checkpointing
from moe_cases import build, make_batch, rel_err, tiny_args

MICRO_BATCHES = 2


def _batch():
    parts = [make_batch(seed) for seed in range(MICRO_BATCHES)]
    return torch.cat([t for t, _ in parts]), torch.cat([y for _, y in parts])


def _step(counts: str, checkpointing: str = "none"):
    """One optimizer step's gradients, mean auxiliary loss, expert-bias counts and the layers' per-forward counts;
    ``counts`` "whole": one forward of the whole batch, else that many micro-batches, with the step's counts first
    (``step``) or without (``micro_batch``)."""
    model = build(tiny_args(aux_loss="global", aux_loss_counts="step", bias_update_rate=0.01))
    apply_activation_checkpointing(model, model.layers, checkpointing)
    tokens, labels = _batch()
    parts = [(tokens, labels)] if counts == "whole" else list(zip(tokens.chunk(2), labels.chunk(2)))
    out = {"aux": 0.0, "forward_counts": 0}
    if counts == "step":
        rng = torch.get_rng_state()
        count_step_tokens(model, [lambda x=x, y=y: model(x, labels=y) for x, y in parts])
        assert torch.equal(torch.get_rng_state(), rng)
        for m in model.moe_layers():  # the counting forward left no bias counts and no loss statistics
            assert not m.tokens_per_expert.any() and not m.stats and m.step_counts is not None
        out["step_counts"] = torch.stack([m.step_counts for m in model.moe_layers()])
    for x, y in parts:
        loss = model(x, labels=y)
        out["forward_counts"] += torch.stack([m.last_counts for m in model.moe_layers()])
        (loss / len(parts)).backward()
        out["aux"] += model.last_aux_loss / len(parts)
    forget_step_counts(model)
    out["grads"] = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    out["bias_counts"] = torch.stack([m.tokens_per_expert for m in model.moe_layers()])
    return out


def test_step_counts_give_the_whole_batch_gradients_under_accumulation():
    whole = _step("whole")
    got = _step("step", checkpointing="full")
    # the counting forward counted exactly what the training forwards then routed, every token once
    assert torch.equal(got["step_counts"][:, :-1], got["forward_counts"])
    assert (got["step_counts"][:, -1] == _batch()[0].numel()).all()
    assert torch.equal(got["bias_counts"], whole["bias_counts"])  # not again in the recomputed forwards
    assert rel_err(got["aux"], whole["aux"]) < 1e-12
    worst = max(rel_err(got["grads"][n], whole["grads"][n]) for n in whole["grads"])
    assert worst < 1e-10, worst
    # without them each micro-batch balances against its own counts: the router's gradient differs
    micro = _step("micro_batch")
    router = "layers.0.moe.router.gate.weight"
    assert rel_err(micro["grads"][router], whole["grads"][router]) > 1e-4
