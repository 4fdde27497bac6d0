"""model.sliding_window: attention limited to the last N tokens; exact zeros outside, parity under dp2 x tp2, pp2, cp2."""

import pytest
import torch

from helpers import TINY, losses
from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError
from lit_titan.models.llama3 import Transformer, get_flavor
from lit_titan.models.llama3.attention import attention_mask
from lit_titan.models.llama3.flops import flops_per_token
from parity import TOL, check_case, run_layout


def _stage(n_layers: int, window: int | None, pattern: int | None = None, attention: str = "sdpa") -> Transformer:
    """The model without its embedding (a first pipeline stage's view): takes hidden states, so their grads exist."""
    args = get_flavor(
        "llama3_debug",
        dim=64,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        sliding_window=window,
        window_pattern=pattern,
        attention=attention,
    )
    model = Transformer(args)
    model.init_weights(seed=0)
    model.tok_embeddings = None
    return model


def _input_grad(model: Transformer, t: int, seq: int = 32) -> torch.Tensor:
    x = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    model(x)[0, t].square().sum().backward()
    return x.grad[0].abs().sum(-1)  # per input position


@pytest.mark.parametrize("n_layers, window", [(1, 8), (2, 8), (3, 5)])
def test_gradient_is_exactly_zero_outside_the_window(n_layers, window):
    t = 27
    reach = n_layers * (window - 1)  # each layer looks window-1 tokens further back
    g = _input_grad(_stage(n_layers, window), t)
    assert torch.all(g[: t - reach] == 0), g
    assert torch.all(g[t - reach : t + 1] > 0), g
    assert torch.all(g[t + 1 :] == 0)  # still causal
    # without the window the same token reads the whole prefix
    assert torch.all(_input_grad(_stage(n_layers, None), t)[: t + 1] > 0)


def test_window_pattern_keeps_every_kth_layer_global():
    args = get_flavor("llama3_debug", n_layers=6, sliding_window=16, window_pattern=3)
    assert [args.window_of(i) for i in range(6)] == [16, 16, None, 16, 16, None]
    # layer 2 global: with 3 layers of window 5 the receptive field is the whole prefix
    g = _input_grad(_stage(3, 5, pattern=3), 27)
    assert torch.all(g[:28] > 0)


def test_window_of_the_whole_sequence_is_full_causal():
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_stage(2, 16)(x), _stage(2, None)(x), rtol=0, atol=0)


def test_flex_block_mask_equals_the_sdpa_mask_with_documents():
    """Forward only: torch 2.15 runs flex forward on CPU (no backward)."""
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([[0] * 10 + [1] * 22, [0] * 20 + [1] * 12])
    sdpa, flex = _stage(2, 6), _stage(2, 6, attention="flex")
    with torch.no_grad():
        torch.testing.assert_close(flex(x, documents=docs), sdpa(x, documents=docs), rtol=1e-5, atol=1e-5)
    dense = attention_mask("sdpa", docs, 32, torch.device("cpu"), window=6)
    assert dense.shape == (2, 1, 32, 32) and int(dense[0, 0, 15].sum()) == 6 and int(dense[0, 0, 12].sum()) == 3


def test_flops_follow_the_window():
    full = get_flavor("llama3_8b")
    win = get_flavor("llama3_8b", sliding_window=1024, window_pattern=4)
    attn_full = flops_per_token(full, 8192) - flops_per_token(full, 0)
    attn_win = flops_per_token(win, 8192) - flops_per_token(win, 0)
    assert attn_win == pytest.approx(attn_full * (8 * 8192 + 24 * 1024) / (32 * 8192))


def test_window_longer_than_seq_len_one_line():
    with pytest.raises(ConfigError) as info:
        validate(compose([*TINY, "model.sliding_window=64"]))  # TINY: data.seq_len=32
    msg = str(info.value)
    assert "model.sliding_window=64: exceeds data.seq_len=32" in msg and "\n" not in msg


# Parity (tests/support/parity.py): every layout's pre-clip gradients, clip norm, weights and losses equal a one-process
# run of the same window, seed and global batch, in parity.PARITY's regime (lr 1e-2, clipping engaged).
WINDOW = ["model.sliding_window=8"]
LAYOUTS = {
    "dp2_tp2": ["cluster.devices=4", "parallel.tp=2"],
    "pp2_accum2": ["cluster.devices=2", "parallel.pp=2", "data.micro_batch_size=4"],
    "cp2": ["cluster.devices=2", "parallel.cp=2"],
}


@pytest.mark.parity
@pytest.mark.slow
def test_sliding_window_matches_single_process(parity_reference, tmp_path, worlds):
    """One reference for the file's layouts (one test: a window reference shared by its cases)."""
    ref = run_layout(worlds, [*WINDOW, "cluster.devices=1"], tmp_path / "one")
    # the window acts: full attention (the session's reference, same config but the window) trains to
    # other losses, far beyond the parity bound
    full = losses(parity_reference)
    assert max(abs(a - b) / a for a, b in zip(losses(ref), full)) > 100 * TOL.loss
    for name, layout in LAYOUTS.items():
        check_case(f"sliding_window_{name}", ref, run_layout(worlds, [*WINDOW, *layout], tmp_path / name))
