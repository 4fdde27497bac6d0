"""The Qwen3-MoE family wired in through the model registry: config, one-line refusals, training, HF adapter.

One process, no process group (the layouts are tests/parity/test_moe_parity.py's): the flavors compose and
validate, bad MoE settings are refused in one line before any work, the module trains the family under a
plain Lightning strategy with the auxiliary loss logged and the expert bias moving, and the registry's
Hugging Face adapter round-trips the weights.
"""

from pathlib import Path

import lightning as L
import pytest
import torch

from lit_titan.config import ConfigError, compose, validate
from lit_titan.models import registry

TINY_MOE = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "ffn_dim": 128,
    "mlp_only_layers": [1],
    "moe": {"num_experts": 8, "top_k": 2, "hidden_dim": 32, "aux_loss_coef": 0.01, "bias_update_rate": 0.01},
}


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["model.moe.top_k=9"], "model.moe.top_k=9: more than model.moe.num_experts=8"),
        (["model.moe.num_experts=0"], "model.moe.num_experts=0: out of range; use a value >= 1"),
        (["model.moe.top_k=0"], "model.moe.top_k=0: out of range; use a value >= 1"),
        (["model.moe.score_func=relu"], "model.moe.score_func=relu: not an option; choose one of softmax, sigmoid"),
        (
            ["model.moe.top_k=1", "model.moe.aux_loss_coef=0"],
            "model.moe.norm_topk_prob=true: with top_k=1, softmax scores and no auxiliary loss",
        ),
        (["model.moe.hidden_dim=abc"], "model.moe.hidden_dim=abc: wrong type"),
        (["cluster.devices=2", "parallel.pp=2"], "model.moe.aux_loss=pooled: not supported with parallel.pp=2"),
        (["model.name=qwen4"], "model.name=qwen4: not a model flavor; choose model=<one of"),
        (
            ["model.moe.aux_loss=sequence", "model.moe.aux_loss_counts=step"],
            "model.moe.aux_loss_counts=step: only the global-batch loss counts tokens over the step",
        ),
        *(
            (
                ["model.moe.aux_loss=global", "model.moe.aux_loss_counts=step", *layout],
                f"model.moe.aux_loss_counts=step: not supported with {layout[-1]} yet",
            )
            for layout in (
                ["cluster.devices=2", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
                ["cluster.devices=2", "parallel.dp_replicate=2", "fault_tolerance.enabled=true"],
            )
        ),
    ],
)
def test_bad_moe_settings_are_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        validate(compose(["model=qwen3_moe_debug", *overrides]))
    assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)


def test_flavors_compose_and_count_active_parameters():
    for flavor in ("qwen3_moe_debug", "qwen3_30b_a3b", "qwen3_235b_a22b"):
        spec = validate(compose([f"model={flavor}", "model.moe.top_k=4", "model.mlp_only_layers=[0]"]))
        assert spec.model.moe.top_k == 4 and spec.model.mlp_only_layers == (0,)
    args = registry.model_args("qwen3_30b_a3b")
    total, active = registry.count_params(args), registry.count_params(args, active=True)
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 1) == 3.4
    # FLOPs follow the active parameters, whatever whole-model count a caller passes
    assert registry.flops_per_token(args, 4096, num_params=total) == registry.flops_per_token(args, 4096)
    assert registry.flops_per_token(args, 4096) < 6 * total / 5
    dense = registry.model_args("llama3_debug")
    assert registry.count_params(dense, active=True) == registry.count_params(dense)


def test_module_trains_the_family_logging_aux_loss_and_moving_the_expert_bias(tmp_path: Path):
    from lit_titan.module import PretrainModule

    module = PretrainModule(
        model="qwen3_moe_debug", model_overrides=TINY_MOE, optim={"lr": 1e-2, "warmup_steps": 1, "total_steps": 2}
    )
    tokens = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader(tokens, batch_size=2)
    trainer.fit(module, loader, loader)
    logged = trainer.logged_metrics
    assert 0 < float(logged["train/aux_loss"]) < float(logged["train/loss"]), logged
    biases = [m.expert_bias for m in module.model.moe_layers()]
    assert all(b.abs().max() > 0 for b in biases) and all(
        m.tokens_per_expert.sum() == 0 for m in module.model.moe_layers()
    )


def test_hf_adapter_round_trips_through_the_registry(tmp_path: Path):
    args = registry.model_args("qwen3_moe_debug", **{**TINY_MOE, "moe": {**TINY_MOE["moe"], "bias_update_rate": 0}})
    adapter = registry.hf_adapter(args, "export")
    model = registry.build_model(args)
    model.init_weights(3)
    from lit_titan.models.qwen3_moe.hf import save_hf

    save_hf(model.state_dict(), args, tmp_path)
    adapter.check_hf_dir(str(tmp_path), args)
    assert dict(adapter.param_shapes(args)) == {
        n: tuple(t.shape) for n, t in adapter.iter_hf_tensors(model.state_dict(), args, torch.float32)
    }
    fresh = registry.build_model(args)
    fresh.init_weights(4)
    adapter.load_hf_weights(fresh, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    with pytest.raises(ValueError, match="export: Qwen3-MoE on Hugging Face has softmax routing"):
        adapter.check_hf_expressible(registry.model_args("qwen3_moe_debug", moe={"score_func": "sigmoid"}), "export")


def test_planner_sizes_the_family_and_searches_only_layouts_its_plan_covers():
    from lit_titan.planner.analytic import analytic_layout
    from lit_titan.planner.search import enumerate_layouts
    from lit_titan.strategies.parallel_dims import ParallelDims

    args = registry.model_args("qwen3_30b_a3b")
    one = analytic_layout(args, ParallelDims(world_size=1, dp_shard=1), None, precision="bf16-mixed")
    assert one.params_total == registry.count_params(args)  # memory: every expert
    cands = enumerate_layouts(args, world=8, seq_len=4096, global_batch=64, gpus_per_node=8, fp8=False)
    assert cands and {c.dims.pp for c in cands} == {1}  # the flavor's pooled auxiliary loss has no per-stage share
    per_layer = registry.model_args("qwen3_30b_a3b", moe={"aux_loss": "global"})
    cands = enumerate_layouts(per_layer, world=8, seq_len=4096, global_batch=64, gpus_per_node=8, fp8=False)
    assert max(c.dims.pp for c in cands) > 1  # the family's pipeline units
    assert max(c.dims.cp for c in cands) > 1  # its attention cores take context parallel
