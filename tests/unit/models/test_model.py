"""Llama 3.1 model: exact sizes, RoPE scaling, stage-tolerant forward, layout-free init."""

import math

import pytest
import torch

from lit_titan.models.llama3 import FLAVORS, Transformer, get_flavor
from lit_titan.models.llama3.args import RopeScaling
from lit_titan.models.llama3.model import scaled_rope_frequencies

EXPECTED_PARAMS = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_parameter_counts_exact(name):
    with torch.device("meta"):
        model = Transformer(get_flavor(name))
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS[name]
    assert model.args.vocab_size == 128256


def test_debug_flavor_shape():
    args = get_flavor("llama3_debug")
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (256, 6, 16, 8)


def _reference_llama31_freqs(head_dim, theta, factor, low, high, old_ctx):
    """Meta's published apply_scaling, written as the scalar loop of the reference code."""
    freqs = [1.0 / (theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_scaling_matches_reference(head_dim):
    ours = scaled_rope_frequencies(head_dim, 500000.0, RopeScaling()).double()
    ref = _reference_llama31_freqs(head_dim, 500000.0, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    # The scaling must actually change something at realistic sizes (guards a no-op).
    unscaled = scaled_rope_frequencies(head_dim, 500000.0, None).double()
    assert not torch.allclose(ours, unscaled)
    assert (ours <= unscaled * (1 + 1e-6)).all()


def _tiny(**kw):
    return get_flavor("llama3_debug", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, **kw)


def test_blocks_with_deleted_siblings_still_run_and_keep_names():
    torch.manual_seed(0)
    full = Transformer(_tiny())
    full.init_weights(seed=3)
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = full(tokens)
        # Stage 0: embedding + blocks 0,1; stage 1: blocks 2,3 + norm + output.
        with torch.device("meta"):
            s0, s1 = Transformer(_tiny()), Transformer(_tiny())
        for stage in (s0, s1):
            stage.to_empty(device="cpu")
            stage.init_weights(seed=3)
        del s0.layers["2"], s0.layers["3"]
        s0.norm = s0.output = None
        del s1.layers["0"], s1.layers["1"]
        s1.tok_embeddings = None
        out = s1(s0(tokens))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    full_names = dict(full.named_parameters())
    for stage in (s0, s1):
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_names[name]), name  # same names, same values: layout-free init
    assert {n for n, _ in s0.named_parameters()} | {n for n, _ in s1.named_parameters()} == set(full_names)


def test_init_is_seeded_and_distinct_per_parameter():
    a, b, c = Transformer(_tiny()), Transformer(_tiny()), Transformer(_tiny())
    a.init_weights(0), b.init_weights(0), c.init_weights(1)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n
    # Different parameters of equal shape must not share values.
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_gqa_and_causality():
    model = Transformer(_tiny())
    model.init_weights(0)
    tokens = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        out = model(tokens)
        changed = tokens.clone()
        changed[0, 8] = (changed[0, 8] + 1) % 128
        out2 = model(changed)
    assert out.shape == (1, 12, 128)
    torch.testing.assert_close(out[:, :8], out2[:, :8])  # the past does not see the future
    assert not torch.allclose(out[:, 8:], out2[:, 8:])


def test_unknown_flavor_names_the_choices():
    with pytest.raises(ValueError, match="llama3_debug"):
        get_flavor("llama3_7b")
    assert set(FLAVORS) == {"llama3_debug", "llama3_8b", "llama3_70b", "llama3_405b", "llama3_2_1b", "llama3_2_3b"}
