"""Float8 callback: conversion filter, refusals, emulated training numerics, dp2 x tp2 composition.

Tolerances (measured on CPU, emulate=True, tiny model dim 64 / 2 layers / vocab 512, bf16-mixed):
- Float8 (tensorwise) vs the same run without Float8, 20 steps, 1 process: max relative loss
  difference 8.4e-5 -> asserted <= 2.5e-4 (3x). The reference is bf16-mixed *without* Float8 (FSDP
  bf16 params, fp32 reduce), so the only difference is the float8 casts of the converted GEMMs.
- Float8 dp2 x tp2, float8_tp tp2 and parallel_block dp2 x tp2 against one Float8 process: the parity
  harness (tests/support/parity.py) with Float8's own measured tolerance, ``FLOAT8_TOL`` below. float8_tp
  changes what the TP all-gathers carry, not the numbers: torchao's float8 styles take the same global
  tensorwise scales (the same run with the ordinary TP styles gave bitwise the same losses, 2026-11-22).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from helpers import run_job
from lit_titan import TitanStrategy
from lit_titan.callbacks.float8 import RECIPES, Float8
from lit_titan.models.llama3 import Transformer, get_flavor
from parity import CLIP, MIN_LOSS_DROP, STEPS, Tolerance, compare, norms
from paths import SCRIPTS

SCRIPT = SCRIPTS / "float8_dp2tp2.py"
TINY_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
BLOCK_LINEARS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def _float8_linear():
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def _meta_model(**overrides) -> nn.Module:
    with torch.device("meta"):
        return Transformer(get_flavor("llama3_debug", **{**TINY_MODEL, **overrides}))


def _run_script(out: Path, devices: int, *args: str) -> dict:
    """The script as a command (GPU tests: a fresh process owns the device)."""
    proc = run_job([sys.executable, str(SCRIPT), str(out), str(devices), *args], timeout=300, cwd=out.parent)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


def _run_in_world(worlds, out: Path, devices: int, *args: str) -> dict:
    """The script's ``main`` on every rank of a reused gloo world (tests/support/world.py)."""
    worlds.run(devices, "scripts.float8_dp2tp2:main", [str(out), str(devices), *args], timeout=300)
    return json.loads(out.read_text())


def _max_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref) > 0
    return max(abs(g - r) / abs(r) for g, r in zip(got, ref))


# ---- conversion filter -------------------------------------------------------------------------
def test_converts_block_linears_not_the_head():
    model = _meta_model()
    cb = Float8(emulate=True, auto_filter_small_kn=False)
    cb.convert(model)
    Float8Linear = _float8_linear()
    for block in model.layers.values():
        for name in BLOCK_LINEARS:  # wk/wv are 64 -> 32: divisible by 16, converted
            assert isinstance(block.get_submodule(name), Float8Linear), name
    assert isinstance(model.output, nn.Linear) and not isinstance(model.output, Float8Linear)  # filter_fqns=["output"]
    assert len(cb.converted) == 2 * len(BLOCK_LINEARS)
    cb.convert(model)  # idempotent: Float8Linear is an nn.Linear, but is not wrapped again
    assert all(type(model.get_submodule(n)) is Float8Linear for n in cb.converted)


def test_moe_converts_attention_and_shared_experts_not_the_router_or_experts():
    """The router scores in fp32 by design (kept even where its width would pass), the routed experts are
    grouped weights (no Linear), the shared experts and attention are dense Linears (converted). Float8 with
    ep2 against one process with Float8 (the parity regime, 8 steps, measured once): within FLOAT8_TOL."""
    from lit_titan.models.qwen3_moe import Qwen3MoE
    from lit_titan.models.qwen3_moe import get_flavor as moe_flavor

    moe = dict(num_experts=16, top_k=2, hidden_dim=32, num_shared_experts=1)
    with torch.device("meta"):
        model = Qwen3MoE(moe_flavor("qwen3_moe_debug", **{**TINY_MODEL, "head_dim": 16, "moe": moe}))
    cb = Float8(emulate=True, auto_filter_small_kn=False)
    cb.convert(model)
    assert model.layers["0"].moe.router.gate.weight.shape == (16, 64)  # passes min_dim, kept by name
    assert not any("router" in n or ".experts." in n for n in cb.converted), cb.converted
    assert {n.split(".", 2)[2] for n in cb.converted} == {
        *(f"attention.w{x}" for x in "qkvo"),
        *(f"moe.shared_experts.w{i}" for i in (1, 2, 3)),
    }


def test_skips_dims_not_divisible_by_min_dim():
    # n_heads=8, n_kv_heads=1: head_dim 8, so wk/wv are 64 -> 8 (not a multiple of 16): kept.
    model = _meta_model(n_heads=8, n_kv_heads=1)
    Float8(emulate=True, auto_filter_small_kn=False).convert(model)
    Float8Linear = _float8_linear()
    attn = model.layers["0"].attention
    assert isinstance(attn.wq, Float8Linear) and isinstance(attn.wo, Float8Linear)
    assert type(attn.wk) is nn.Linear and type(attn.wv) is nn.Linear
    # dim 72: every block Linear has a 72-wide side -> nothing converted.
    model = _meta_model(dim=72)
    Float8(emulate=True, auto_filter_small_kn=False).convert(model)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_auto_filter_skips_small_gemms():
    # torchao's _auto_filter_for_recipe (H100 thresholds) leaves the tiny model's GEMMs in bf16.
    model = _meta_model()
    Float8(emulate=True).convert(model)
    assert not any(isinstance(m, _float8_linear()) for m in model.modules())


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_a_step(recipe):
    model = _meta_model()
    Float8(recipe=recipe, emulate=True, auto_filter_small_kn=False).convert(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, 512, (2, 16))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---- refusals ----------------------------------------------------------------------------------
def test_refuses_non_titan_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match="Float8 needs lit_titan.TitanStrategy"):
        Float8(emulate=True).setup(trainer, None, "fit")


def test_refuses_cpu_without_emulate_and_registers_with_it():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TitanStrategy(), logger=False)
    with pytest.raises(RuntimeError, match=r"emulate=True"):
        Float8().setup(trainer, None, "fit")
    assert trainer.strategy._transforms["convert"] == []
    cb = Float8(emulate=True)
    cb.setup(trainer, None, "fit")
    cb.setup(trainer, None, "validate")  # Lightning calls setup per stage: register once
    assert trainer.strategy._transforms["convert"] == [cb.convert]


def test_unknown_recipe_and_float8_tp_only_tensorwise():
    with pytest.raises(ValueError, match="tensorwise.*rowwise.*rowwise_with_gw_hp"):
        Float8(recipe="blockwise")
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.raises(ValueError, match="float8_tp=True.*tensorwise"):
            Float8(recipe=recipe, float8_tp=True)
    Float8(recipe="rowwise")  # float8_tp=False: fine
    assert Float8(float8_tp=True).float8_tp


def test_float8_tp_from_hydra():
    from hydra.utils import instantiate

    from lit_titan.config import compose

    assert instantiate(compose(["callbacks=[float8]"]).callbacks.float8).float8_tp is False
    cb = instantiate(compose(["callbacks=[float8]", "callbacks.float8.float8_tp=true"]).callbacks.float8)
    assert isinstance(cb, Float8) and cb.float8_tp and cb.recipe == "tensorwise"


def test_float8_tp_registers_its_style_rewrite():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TitanStrategy(), logger=False)
    Float8(emulate=True).setup(trainer, None, "fit")
    assert trainer.strategy._tp_style_rewrites == []  # float8_tp=False: the plan's styles
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TitanStrategy(), logger=False)
    cb = Float8(emulate=True, float8_tp=True)
    cb.setup(trainer, None, "fit")
    cb.setup(trainer, None, "validate")
    assert trainer.strategy._transforms["convert"] == [cb.convert]
    assert trainer.strategy._tp_style_rewrites == [cb.tp_style]


def test_all_gather_and_precompute_only_for_tensorwise():
    cb = Float8(recipe="rowwise", emulate=True)
    assert not cb.enable_fsdp_float8_all_gather and not cb.precompute_scales
    assert not cb.float8_config().enable_fsdp_float8_all_gather
    cfg = Float8(emulate=True).float8_config()
    assert cfg.enable_fsdp_float8_all_gather and cfg.emulate


# ---- float8 tensor-parallel styles (float8_tp) ----------------------------------------------------
def _float8_tp_plans(model: nn.Module, cb: Float8) -> list[tuple[dict, dict]]:
    """(plan's styles, rewritten styles) by full name, as apply_tensor_parallel would apply them."""
    from lit_titan.models.llama3.parallelize import LLAMA3_PLAN
    from lit_titan.strategies.tensor_parallel import tp_plans

    cb.convert(model)
    names = {id(m): n for n, m in model.named_modules()}

    def by_name(pairs):
        out = {}
        for module, styles in pairs:
            prefix = names[id(module)]
            items = styles.items() if isinstance(styles, dict) else [("<stage io>", styles)]
            for key, style in items:
                out[".".join(p for p in (prefix, key) if p)] = style
        return out

    # loss_parallel=True: the output head's style is the one with use_local_output=False
    return by_name(tp_plans(model, LLAMA3_PLAN, True)), by_name(tp_plans(model, LLAMA3_PLAN, True, [cb.tp_style]))


def _layouts(style) -> dict:
    keys = (
        "input_layouts",
        "output_layouts",
        "desired_input_layouts",
        "use_local_output",
        "with_kwargs",
        "input_kwarg_layouts",
        "desired_input_kwarg_layouts",
    )
    return {k: getattr(style, k) for k in keys if hasattr(style, k)}


ATTN = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FFN = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


@pytest.mark.parametrize("case", ["all_converted", "wk_wv_too_small", "w2_filtered", "pipeline_middle_stage"])
def test_float8_tp_styles_exactly_where_converted(case):
    """float8 styles for the converted Linears and the inputs gathered only for them; the plan's elsewhere."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    float8_of = {
        ColwiseParallel: Float8ColwiseParallel,
        RowwiseParallel: Float8RowwiseParallel,
        PrepareModuleInput: PrepareFloat8ModuleInput,
    }
    kwargs = {"emulate": True, "auto_filter_small_kn": False, "float8_tp": True}
    linears, prepared = ATTN + FFN, ("attention", "feed_forward")
    if case == "wk_wv_too_small":  # head_dim 8: wk/wv are 64 -> 8, kept in bf16 -> attention's input too
        model = _meta_model(n_heads=8, n_kv_heads=1)
        linears, prepared = ("attention.wq", "attention.wo") + FFN, ("feed_forward",)
    elif case == "w2_filtered":  # feed_forward's input still goes to w1/w3 only, but w2 is not float8
        model, kwargs["filter_fqns"] = _meta_model(), ["output", "w2"]
        linears, prepared = ATTN + ("feed_forward.w1", "feed_forward.w3"), ("attention",)
    else:
        model = _meta_model()
    if case == "pipeline_middle_stage":  # no embedding/head: the stage boundary styles stay as planned
        model.tok_embeddings = model.norm = model.output = None
    cb = Float8(**kwargs)
    planned, rewritten = _float8_tp_plans(model, cb)
    expected = {f"layers.{i}.{n}" for i in ("0", "1") for n in linears + prepared}
    assert set(cb.converted) == {f"layers.{i}.{n}" for i in ("0", "1") for n in linears}
    assert planned.keys() == rewritten.keys()
    if case == "pipeline_middle_stage":
        assert "<stage io>" in planned and "output" not in planned
    else:
        assert {"tok_embeddings", "norm", "output"} <= planned.keys()
    for name, style in rewritten.items():
        plan_style = planned[name]
        if name in expected:
            assert type(style) is float8_of[type(plan_style)], (name, style)
        else:  # the output head (filtered), norms, embedding, kept Linears, stage io
            assert type(style) is type(plan_style), (name, style)
        assert _layouts(style) == _layouts(plan_style), name  # same layouts, use_local_output included
    # the residual stream stays a Shard(1) DTensor (local tensors there make FSDP x TP x compile train silently wrong)
    wo = rewritten["layers.0.attention.wo"]
    assert wo.output_layouts == (Shard(1),) and wo.use_local_output is False
    assert sum(isinstance(s, tuple(float8_of.values())) for s in rewritten.values()) == len(expected)


def _count_float8_tp_all_gathers(monkeypatch) -> list[int]:
    """Count the all-gathers of torchao float8 tensors (the float8 TP styles' collectives)."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    count = [0]
    for op in (
        torch.ops.c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
    ):

        def watched(aten_op, args, kwargs=None, original=FLOAT8_OPS_TABLE[op]):
            count[0] += 1
            return original(aten_op, args, kwargs)

        monkeypatch.setitem(FLOAT8_OPS_TABLE, op, watched)
    return count


def _float8_tp_over_fake_pg(device: str, emulate: bool, monkeypatch) -> dict:
    """tp2 (rank 0 of 2) over a fake process group: the planner's registration, TitanStrategy.parallelize,
    then one forward/backward. Fake collectives move no data: this checks what runs, not the numbers."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lit_titan.planner.build import fake_process_group, request_transforms
    from lit_titan.strategies.parallel_dims import ParallelDims

    gathers = _count_float8_tp_all_gathers(monkeypatch)
    seen = {}

    def record(fqn, module, style):
        seen[fqn] = type(style).__name__
        return style

    cb = Float8(emulate=emulate, auto_filter_small_kn=False, float8_tp=True)
    with fake_process_group(2):
        strategy = TitanStrategy(tp=2, dp_shard=1)
        strategy.init_layout(ParallelDims.resolve(2, dp_shard=1, tp=2), device)
        request_transforms(strategy, [cb])  # as the planner asks for Float8
        assert strategy._tp_style_rewrites == [cb.tp_style]
        strategy.register_tp_style_rewrite(record)  # runs after Float8's: sees what TP applies
        model, _ = strategy.parallelize(_meta_model(), "32-true")
        model.to_empty(device=device)
        model.init_weights(seed=0, buffer_device=torch.device(device))
        tokens = torch.randint(0, 512, (2, 32), device=device)
        with loss_parallel():
            logits = model(tokens)
            gathers_forward = gathers[0]
            nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert isinstance(logits, DTensor) and logits.shape == (2, 32, 512)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    return {"seen": seen, "gathers_forward": gathers_forward, "gathers": gathers[0], "converted": cb.converted}


def test_float8_tp_through_strategy_and_planner_over_fake_pg(monkeypatch):
    """The planner's registration reaches TitanStrategy.parallelize, whose TP applies the float8 styles
    (torchao's _apply accepts each module) and whose forward/backward issues float8 all-gathers."""
    got = _float8_tp_over_fake_pg("cpu", emulate=True, monkeypatch=monkeypatch)
    assert len(got["converted"]) == 14
    for i in ("0", "1"):
        assert (
            got["seen"][f"layers.{i}.attention"]
            == got["seen"][f"layers.{i}.feed_forward"]
            == "PrepareFloat8ModuleInput"
        )
        assert {got["seen"][f"layers.{i}.{n}"] for n in ("attention.wq", "feed_forward.w1")} == {
            "Float8ColwiseParallel"
        }
        assert {got["seen"][f"layers.{i}.{n}"] for n in ("attention.wo", "feed_forward.w2")} == {
            "Float8RowwiseParallel"
        }
    # the head stays bf16: its style is the plan's own ColwiseParallel subclass (LossHeadColwise)
    assert got["seen"]["output"] in ("ColwiseParallel", "LossHeadColwise")
    assert got["seen"]["tok_embeddings"] == "RowwiseParallel"
    # per block: forward gathers the attention and feed-forward inputs, backward the wo and w2 output
    # gradients, each in float8 (the other TP collectives stay in high precision)
    assert got["gathers_forward"] == 2 * 2 and got["gathers"] == 2 * 4


# ---- training ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory, worlds):
    d = tmp_path_factory.mktemp("float8_runs")
    return {
        "float8": _run_in_world(worlds, d / "float8.json", 1),
        "bf16": _run_in_world(worlds, d / "bf16.json", 1, "float8=0"),
    }


def test_emulated_float8_tracks_bf16(single_process_runs):
    f8, ref = single_process_runs["float8"], single_process_runs["bf16"]
    assert f8["float8_modules"] == 14 and ref["float8_modules"] == 0
    assert len(f8["losses"]) == 20
    worst = _max_rel(f8["losses"], ref["losses"])
    assert 0 < worst <= 2.5e-4, (worst, f8["losses"], ref["losses"])  # > 0: the float8 casts did run
    assert sum(f8["losses"][-5:]) < sum(f8["losses"][:5])  # the loss falls
    # tensorwise + FSDP (bf16-mixed wraps even one process): the FP8 all-gather path, with scales
    # precomputed after every optimizer step (none before the first).
    assert f8["weight_types"] == ["WeightWithDynamicFloat8CastTensor"]
    assert f8["all_gather_dtypes"] == ["torch.float8_e4m3fn"]
    assert f8["scales_set"] == [0] + [14] * 19


# ---- parity with one process, Float8 (emulated) on both sides: tests/support/parity.py's harness ----------
# The parity regime (fp32, lr 1e-2, 8 steps, clipping at 0.3 engaged every step): pre-clip gradients,
# clip norm and weights at steps 0, 4 and 7, and every loss, against one Float8 process (this file's
# reference, shared by the two plain-block cases).
# Micro-batches of 4 samples, accumulated up to each rank's share of the 8 (so accumulation runs with
# Float8 in the reference and the tp2 case).
FLOAT8_PARITY = ["precision=32-true", "optim.lr=1e-2", f"steps={STEPS}", f"clip={CLIP}", "data.micro_batch_size=4"]
# Float8's own tolerance. Noise floor, measured 2026-11-25 (CPU, gloo, torch 2.15, emulated; the worst
# over the three cases below against their one-process Float8 reference, PARITY_RECORD): clip norm
# 5.4e-4 (dp2 x tp2: 4.3e-5, tp2: 8.9e-5), loss 2.0e-4, but gradients 0.21 per parameter (max |diff| /
# max |ref|) and weights 0.62. Not understood yet: dp2 x tp2's gradients are 0.09 off (7.5% in Frobenius
# norm) already at step 0, same weights, where tp2 alone is 1.4e-3 off (3e-7 without accumulation); a
# suspect, not checked, is the FSDP float8 all-gather's weight scale (its amax reduced over the
# data-parallel mesh only?) against one process's whole-tensor scale. So the clip norm and the losses are
# Float8's oracle (a gradient-scale error of 1% is 4x the norm's bound); the gradient and weight bounds
# catch gross errors only. Each bound is about 4x its floor.
FLOAT8_TOL = Tolerance(grads=0.8, norm=2.5e-3, params=2.5, loss=1e-3)


def _float8_parity_run(worlds, run_dir: Path, devices: int, *args: str) -> dict:
    """FLOAT8_PARITY on ``devices`` ranks; micro-batches of 4 accumulated up to each rank's share of 8."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dp = 2 if "dp_shard=2" in args else 1
    return _run_in_world(
        worlds,
        run_dir / "run.json",
        devices,
        *FLOAT8_PARITY,
        f"accumulate={8 // dp // 4}",
        f"dump={run_dir / 'dump'}",
        *args,
    )


def _check_float8_parity(case: str, ref: dict, ref_dir: Path, got: dict, got_dir: Path) -> None:
    """The reference learns with clipping engaged; gradients, norms, weights and losses match it."""
    import os

    assert ref["losses"][0] - ref["losses"][-1] >= MIN_LOSS_DROP, f"the reference did not learn: {ref['losses']}"
    assert min(norms(ref_dir / "dump").values()) > CLIP, "clipping never engaged in the reference"
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    report = compare(ref_dir / "dump", got_dir / "dump")
    report.add("loss", _max_rel(got["losses"], ref["losses"]), "worst step")
    if os.environ.get("PARITY_RECORD"):  # the noise floor measurement (see FLOAT8_TOL)
        with open(os.environ["PARITY_RECORD"], "a") as f:
            f.write(json.dumps({"case": case, **{k: v[0] for k, v in report.worst.items()}}) + "\n")
    ratio, what = report.margin(FLOAT8_TOL)
    assert ratio <= 1.0, f"{case}: parity broken: {what}\n  all: {report.summary()}"


@pytest.fixture(scope="module")
def float8_reference(tmp_path_factory, worlds) -> tuple[dict, Path]:
    run_dir = tmp_path_factory.mktemp("float8_parity") / "one"
    return _float8_parity_run(worlds, run_dir, 1), run_dir


@pytest.mark.parity
@pytest.mark.slow
def test_float8_dp2_tp2_gloo(float8_reference, tmp_path, worlds):
    # ordinary TP styles; FP8 all-gather over gloo (FSDP over dp_shard=2 gathers the float8 weights)
    got = _float8_parity_run(worlds, tmp_path, 4, "dp_shard=2", "tp=2")
    assert got["float8_modules"] == 14
    assert got["all_gather_dtypes"] == ["torch.float8_e4m3fn"]
    assert got["scales_set"] == [0] + [14] * (STEPS - 1)
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    _check_float8_parity("float8_dp2tp2", *float8_reference, got, tmp_path)


@pytest.mark.parity
@pytest.mark.slow
def test_float8_tp_tp2_gloo_matches_one_process(float8_reference, tmp_path, worlds):
    # Real float8 TP styles over 2 gloo processes; gloo has no float8 collectives, so the script sends
    # those all-gathers as their bytes (uint8 views: same bytes, other transport dtype). fp32 and no data
    # parallelism: no FSDP here (test_float8_dp2_tp2_gloo and the bf16-mixed run check its FP8 all-gather).
    # Two accumulated micro-batches per step, as in the reference.
    got = _float8_parity_run(worlds, tmp_path, 2, "tp=2", "dp_shard=1", "float8.float8_tp=true")
    assert got["float8_modules"] == 14
    # steps x micro-batches x blocks x (2 forward + 2 backward)
    assert got["tp_float8_all_gathers"] == STEPS * 2 * 2 * 4
    _check_float8_parity("float8_tp_tp2", *float8_reference, got, tmp_path)


@pytest.mark.parity
@pytest.mark.slow
def test_float8_parallel_block_dp2_tp2_matches_one_process(tmp_path, worlds):
    """model.parallel_block=true under Float8 (emulated): the same 14 block linears convert, and dp2 x tp2 (one
    fused reduction per block, FP8 all-gather) matches one process of the same parallel-block model.

    Seen before the harness (losses only, 5 steps): 3.8e-5; with the block's TP reduction dropped (wo/w2
    local partial sums passed on as if replicated) 6.0e-3. The losses alone do not tell the two block forms
    apart under Float8, so the model's structure shows the setting arrived: no ffn_norm
    (test_parallel_block.py shows it in fp32)."""
    one = _float8_parity_run(worlds, tmp_path / "one", 1, "model.parallel_block=true")
    got = _float8_parity_run(worlds, tmp_path / "dp2tp2", 4, "dp_shard=2", "tp=2", "model.parallel_block=true")
    for r in (one, got):
        assert r["float8_modules"] == 14 and r["ffn_norms"] == 0, r
    # FSDP over dp_shard=2 gathers the float8 weights in float8 (one fp32 process has no FSDP all-gather)
    assert got["all_gather_dtypes"] == ["torch.float8_e4m3fn"], got
    assert got["scales_set"] == [0] + [14] * (STEPS - 1), got
    _check_float8_parity("float8_parallel_block_dp2tp2", one, tmp_path / "one", got, tmp_path / "dp2tp2")


# ---- real FP8 hardware -------------------------------------------------------------------------
@pytest.mark.gpu
def test_float8_real_fp8_on_gpu(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 units (compute capability >= 8.9)")
    f8 = _run_script(tmp_path / "float8.json", 1, "accelerator=gpu", "float8.emulate=false")
    ref = _run_script(tmp_path / "bf16.json", 1, "accelerator=gpu", "float8=0")
    assert f8["float8_modules"] == 14
    assert f8["all_gather_dtypes"] == ["torch.float8_e4m3fn"]
    assert _max_rel(f8["losses"], ref["losses"]) <= 1e-3  # CPU emulation: 8.4e-5; cuBLAS fast-accum differs
    assert sum(f8["losses"][-5:]) < sum(f8["losses"][:5])


@pytest.mark.gpu
def test_float8_tp_real_fp8_kernels_on_one_gpu(monkeypatch):
    """What one GPU can show about float8_tp, and what it cannot.

    Covers: (1) NCCL in this torch build accepts a float8 all-gather (the collective gloo refuses
    with "Invalid scalar type"), on a 1-rank group, so the dtype path only, not a transfer between
    GPUs; (2) the float8 TP styles with our plan's layouts (Shard(1) DTensor residual stream, loss
    parallel) running forward and backward through the real FP8 GEMMs (``_scaled_mm``, not emulated)
    at tp2 shard shapes, as rank 0 of a fake 2-rank process group.
    Does not cover: numerics of a real tp2 run (fake collectives move no data; NCCL refuses two ranks
    on one GPU, so that needs >= 2 GPUs; the CPU test over gloo checks the numerics with emulation),
    speed, torch.compile.
    """
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 units (compute capability >= 8.9)")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        x = torch.randn(64, 32, device="cuda").to(torch.float8_e4m3fn)
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, dist.group.WORLD))
        assert gathered.dtype == torch.float8_e4m3fn
        assert torch.equal(gathered.view(torch.uint8), x.view(torch.uint8))
    finally:
        dist.destroy_process_group()

    got = _float8_tp_over_fake_pg("cuda", emulate=False, monkeypatch=monkeypatch)
    assert len(got["converted"]) == 14
    assert got["seen"]["layers.0.attention.wq"] == "Float8ColwiseParallel"
    assert got["gathers"] == 2 * 4
