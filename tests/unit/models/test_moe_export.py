"""Qwen3-MoE through `lit-titan export` and `model.init_from_hf`: a run trained with the expert bias exports
exactly (the bias left out, said in one line), `model.moe.*` overrides pass wherever `model.KEY=` does,
training starts from the export with the bias on (the bias at 0, said in one line), and what Hugging Face
cannot hold is refused in one line."""

from pathlib import Path

import pytest
import torch

from helpers import TINY, final_params
from lit_titan.checkpoint import published
from lit_titan.cli import export
from lit_titan.config import ConfigError, compose, validate
from lit_titan.config.spec import model_args
from lit_titan.models import registry

MOE_MODEL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=512",
    "model.head_dim=16",
    "model.ffn_dim=128",
    "model.moe.num_experts=4",
    "model.moe.hidden_dim=32",
    "model.moe.bias_update_rate=0.01",
]
RUN = [
    *(o for o in TINY if not o.startswith("model.")),
    "model=qwen3_moe_debug",
    *MOE_MODEL,
    "seed=0",
    "precision=32-true",
    "callbacks=[]",
    "trainer.limit_val_batches=0",
]
BIAS_NOTE = "model.moe.bias_update_rate=0.01: the expert bias"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, worlds) -> Path:
    """Two steps of a tiny MoE with aux-loss-free balancing, one process."""
    run_dir = tmp_path_factory.mktemp("moe") / "run"
    worlds.train([*RUN, "trainer.max_steps=2", "cluster.devices=1"], run_dir)
    return run_dir


def one_note(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if BIAS_NOTE in line]
    assert len(lines) == 1, stderr
    return lines[0]


def test_expert_bias_run_exports_with_moe_overrides_and_trains_from_the_export(trained, tmp_path, worlds, capsys):
    ckpt = published(trained / "checkpoints")[-1]
    out = export.main([str(ckpt), str(tmp_path / "hf"), "--model", "qwen3_moe_debug", *MOE_MODEL])
    assert "is not exported" in one_note(capsys.readouterr().err)
    args = model_args(compose(["model=qwen3_moe_debug", *MOE_MODEL]))
    expected = final_params(trained)
    biases = [v for k, v in expected.items() if k.endswith("moe.expert_bias")]
    assert biases and any(b.abs().max() > 0 for b in biases)  # the run did move the bias

    fresh = registry.build_model(args)
    fresh.init_weights(7)
    registry.hf_adapter(args, "test").load_hf_weights(fresh, str(out))
    for name, value in fresh.named_parameters():
        assert torch.equal(value, expected[f"model.{name}"]), name

    again = worlds.train(
        [*RUN, "trainer.max_steps=1", "cluster.devices=1", "checkpoint.enabled=false", f"model.init_from_hf={out}"],
        tmp_path / "again",
    )
    assert "starts at 0" in one_note(again.output)


def test_export_from_the_run_config_says_the_bias_is_left_out(trained, tmp_path, capsys):
    ckpt = published(trained / "checkpoints")[-1]
    export.main([str(ckpt), str(tmp_path / "hf")])  # the model from the run's config.yaml
    one_note(capsys.readouterr().err)
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["model.moe.num_experts=8"], "the checkpoint does not match the model config"),
        (["model.moe.score_func=sigmoid"], "export: Qwen3-MoE on Hugging Face has softmax routing"),
        (["model.moe.nope=1"], "model.moe.nope"),
        (["data.seq_len=8"], "only model.KEY=VALUE overrides"),
    ],
)
def test_bad_moe_exports_exit_2_in_one_line(trained, tmp_path, capsys, extra, needle):
    ckpt = published(trained / "checkpoints")[-1]
    with pytest.raises(SystemExit) as info:
        export.main([str(ckpt), str(tmp_path / "hf"), "--model", "qwen3_moe_debug", *MOE_MODEL, *extra])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("lit-titan: error: ") and "\n" not in err, err
    assert needle in err and not (tmp_path / "hf").exists(), err


def test_init_from_hf_of_an_inexpressible_moe_is_one_config_error(tmp_path):
    cfg = compose([*RUN, "model.moe.score_func=sigmoid", f"model.init_from_hf={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value).startswith(f"model.init_from_hf={tmp_path}: Qwen3-MoE on Hugging Face"), info.value
