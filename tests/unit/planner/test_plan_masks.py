"""The planner counts the dense masks of the SDPA path (sliding window, documents), and only those.

``estimate.attention_mask_bytes`` against what a real forward on CPU keeps: the bool masks the model
builds, and the additive copies SDPA saves for backward (found with torch's saved-tensor hooks).
"""

from __future__ import annotations

import pytest
import torch

from lit_titan.models.llama3 import Transformer, get_flavor
from lit_titan.models.llama3.attention import attention_mask, window_mask
from lit_titan.planner import estimate

GIB = 1024**3
S, B, LAYERS = 40, 2, 4  # S differs from every model width (64, 16, 128, ...): a [.., S, S] tensor is a mask


def _model(**kw) -> Transformer:
    model = Transformer(
        get_flavor("llama3_debug", dim=64, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=128, **kw)
    )
    model.init_weights(seed=0)
    return model


def _saved_masks(model: Transformer, documents: torch.Tensor | None) -> int:
    """Bytes of the distinct [.., s, s] float tensors autograd saves in one forward: SDPA's additive masks."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and tuple(t.shape[-2:]) == (S, S) and t.is_floating_point():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 128, (B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens) if documents is None else model(tokens, documents=documents)
    return sum(storages.values())


def _bool_masks(args, documents: torch.Tensor | None) -> int:
    """Bytes of the bool masks the SDPA path holds: what attention_mask returns plus window_mask's cache."""
    window_mask.cache_clear()
    windows = {args.window_of(i) for i in range(args.n_layers)}
    built = [attention_mask("sdpa", documents, S, torch.device("cpu"), window=w) for w in windows]
    if documents is None:  # no mask is passed down; the windowed layers take window_mask's cached one
        built = [window_mask(S, w, torch.device("cpu")) for w in windows if w is not None]
    total = sum(m.untyped_storage().nbytes() for m in built if m is not None)
    if documents is not None:  # and the cached bands the document masks were built from
        total += window_mask.cache_info().currsize * S * S
    return total


@pytest.mark.parametrize(
    "kw, docs",
    [
        ({}, False),
        ({"sliding_window": 8}, False),
        ({"sliding_window": 8, "window_pattern": 2}, False),
        ({}, True),
        ({"sliding_window": 8, "window_pattern": 2}, True),
    ],
)
def test_estimate_matches_the_masks_a_cpu_forward_keeps(kw, docs):
    model = _model(**kw)
    documents = torch.tensor([[0] * 15 + [1] * (S - 15), [0] * S]) if docs else None
    got = estimate.attention_mask_bytes(model.args, S, B, document_masking=docs, act_elem=4, layers_kept=LAYERS)
    saved, bools = _saved_masks(model, documents), _bool_masks(model.args, documents)
    assert got["saved"] == saved and got["bool"] == bools, (got, saved, bools)
    if kw or docs:
        assert saved > 0 and bools > 0  # the cases measure something
    else:
        assert saved == bools == 0  # plain causal: is_causal, nothing dense


BASE = [
    "model=llama3_8b",
    "cluster=h100_8",
    "parallel.tp=8",
    "data.seq_len=32768",
    "data.global_batch_size=8",
    "data.micro_batch_size=1",
]


def _acts(*extra: str) -> dict:
    from lit_titan.cli.plan import make_plan

    return make_plan([*BASE, *extra], write=False)["per_rank"]["activation_detail"]


def test_plan_counts_sdpa_masks_at_32k_and_not_flex_or_causal():
    plain = _acts()
    window = _acts("model.sliding_window=4096")
    flex = _acts("model.sliding_window=4096", "model.attention=flex")
    docs = _acts("data.document_masking=true")
    assert plain["attention_mask"] == 0 and flex["attention_mask"] == 0
    assert flex["total"] == plain["total"]
    # one cached [s, s] bool (1 GiB) + 32 layers' bf16 additive copies saved for backward (2 GiB each)
    assert window["attention_mask_detail"] == {"bool": GIB, "saved": 32 * 2 * GIB, "per_layer": 2 * GIB}
    assert window["total"] - plain["total"] == 65 * GIB
    # documents: the causal band [s, s] and this forward's [1, 1, s, s] bool, and the same additive copies
    assert docs["attention_mask_detail"] == {"bool": 2 * GIB, "saved": 32 * 2 * GIB, "per_layer": 2 * GIB}
    # full activation checkpointing: nothing saved across blocks, one block's copy while it recomputes
    full = _acts(
        "model.sliding_window=4096",
        "callbacks=[activation_checkpointing]",
        "callbacks.activation_checkpointing.mode=full",
    )
    assert full["attention_mask_detail"]["saved"] == 0 and full["recompute_peak"] >= 2 * GIB
