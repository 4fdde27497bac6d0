"""model.mup=true (muP) on one process: the standard parametrisation at base width = width, the rules at
other widths, the refusals, and the coordinate check of benchmarks/mup_coord_check.py.

Under FSDP x TP: tests/parity/test_muon_parity.py::test_mup_dp2_tp2_matches_single_process.
"""

import importlib.util
import math

import pytest
import torch

from helpers import TINY
from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError
from lit_titan.models.llama3.args import ModelArgs
from lit_titan.models.llama3.model import Transformer
from lit_titan.optim.build import OptimConfig, build_optimizer
from paths import ROOT


def _model(**mup):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32, max_seq_len=32)
    model = Transformer(args.with_overrides(**mup))
    model.init_weights(seed=0)
    return model


def _train(model, optim, steps=3):
    opt = build_optimizer(model, OptimConfig(name=optim, lr=1e-2, warmup_steps=0))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (4, 33), generator=gen)
        opt.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_base_width_equal_to_the_width_is_exactly_the_standard_parametrisation(optim, one_thread):
    sp_losses, _ = _train(sp := _model(), optim)
    mup_losses, opt = _train(mup := _model(mup=True, mup_base_width=64), optim)
    if optim == "adamw":  # muP's split is in use: hidden matrices, other matrices, norms (SP: two groups)
        assert len(opt.param_groups) == 3
    assert mup_losses == sp_losses
    for (name, a), b in zip(sp.named_parameters(), mup.parameters()):
        assert torch.equal(a, b), name


def test_mup_rules_at_four_times_the_base_width():
    """m = 4: hidden std / 2, head std of the base width, logits / 4, q / 2; hidden lr / 4 (AdamW), / 2 (Muon)."""
    sp, mup = _model(), _model(mup=True, mup_base_width=16)
    for (name, a), b in zip(sp.named_parameters(), mup.parameters()):
        # the same draws (seeded by name), scaled
        ratio = 0.5 if name.startswith("layers.") and a.ndim == 2 else 2.0 if name.startswith("output.") else 1.0
        torch.testing.assert_close(b, a * ratio, msg=name)  # output: 16^-1/2 against 64^-1/2
    assert mup.output.logit_scale == 0.25 and mup.layers["0"].attention.q_scale == 0.5
    hidden = {id(p) for n, p in mup.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    for optim, factor in (("adamw", 0.25), ("muon", 0.5)):
        opt = build_optimizer(mup, OptimConfig(name=optim, lr=1e-2))
        for group in opt.param_groups:
            inside = {id(p) in hidden for p in group["params"]}
            assert len(inside) == 1, group.keys()  # a group is all hidden or all not
            assert math.isclose(group["lr"], 1e-2 * (factor if inside.pop() else 1.0)), (optim, group["lr"])


def test_mup_refusals_one_line():
    for overrides, key in (
        (["model.mup=true"], "model.mup=true"),
        (["model.mup=true", "model.mup_base_width=32", "optim=lamb"], "optim.name=lamb"),
        (["model.mup_base_width=0"], "model.mup_base_width=0"),
    ):
        with pytest.raises(ConfigError) as info:
            validate(compose([*TINY, *overrides]))
        assert key in str(info.value) and "\n" not in str(info.value), str(info.value)


def _coord_check_module():
    spec = importlib.util.spec_from_file_location("mup_coord_check", ROOT / "benchmarks" / "mup_coord_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Slope of log2(mean |output|) against log2(width) after 5 AdamW steps at lr 1e-2, widths 64/128/256 (seen
# 2026-11-25: muP within [-0.27, +0.01], SP's hidden outputs +1.08 to +1.84)
FLAT, STEEP = 0.4, 0.8


def test_coordinate_check_is_flat_with_mup_and_not_without(one_thread):
    cc = _coord_check_module()
    with_mup, without = cc.slopes(cc.coord_check(mup=True)), cc.slopes(cc.coord_check(mup=False))
    print({k: (round(with_mup[k], 2), round(without[k], 2)) for k in with_mup})
    assert len(with_mup) == 9  # embedding, 2 x (attention, feed_forward, block), norm, logits
    assert all(abs(s) < FLAT for s in with_mup.values()), with_mup
    hidden = [k for k in without if k.startswith("layers.")]
    assert all(without[k] > STEEP for k in hidden), without
