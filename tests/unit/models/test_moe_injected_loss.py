"""The auxiliary loss each MoE layer back-propagates itself (pipeline stages: ``models/injected_loss.py``) gives
the gradients of the model's loss with the auxiliary loss added, and logs the same value; the pooled loss,
which no layer can split off, is refused. One process, fp64: the multi-process proof is the pp parity cases of
tests/parity/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch

from lit_titan.models.injected_loss import losses_in_backward
from lit_titan.models.moe import take_injected_aux_loss
from moe_cases import build, make_batch, rel_err, tiny_args


@pytest.mark.parametrize("kind", ["global", "sequence"])
def test_layers_back_propagating_their_aux_loss_give_the_models_gradients(kind):
    args = tiny_args(aux_loss=kind)  # two MoE layers around a dense one
    reference, ours = build(args), build(args)
    tokens, labels = make_batch()
    scale = 0.25  # what a pipeline of 2 micro-batches with 2 accumulation steps applies to its loss
    full = reference(tokens, labels=labels)
    (full * scale).backward()
    with losses_in_backward(scale):
        head_only = ours(tokens, labels=labels)  # the layers leave nothing for the head's loss to add
    (head_only * scale).backward()
    assert abs(head_only.item() + reference.last_aux_loss.item() - full.item()) < 1e-12
    grads = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, grads[name].grad) < 1e-10, name
    logged = take_injected_aux_loss(ours, torch.device("cpu"))
    assert abs(logged.item() / reference.last_aux_loss.item() - 1) < 1e-6  # logged in fp32
    assert take_injected_aux_loss(ours, torch.device("cpu")).item() == 0  # taken once


def test_pooled_aux_loss_is_not_back_propagated_by_a_layer():
    model = build(tiny_args(aux_loss="pooled"))
    tokens, labels = make_batch()
    with losses_in_backward(1.0), pytest.raises(RuntimeError, match="model.moe.aux_loss=pooled: a product of sums"):
        model(tokens, labels=labels)
