"""Hugging Face interop: export a checkpoint as a HF Llama directory (same logits in `transformers`),
start training from one (`model.init_from_hf`) under any layout, refuse bad inputs."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaForCausalLM

from helpers import TINY, assert_losses_match, final_params, losses, run_job
from lit_titan.cli import export
from lit_titan.config import ConfigError, compose, validate
from lit_titan.models.llama3 import Transformer, get_flavor, hf

TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512"]
NOT_MODEL = [o for o in TINY if not o.startswith("model.")]
ARGS = get_flavor("llama3_debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512)
TOKENS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))


def seeded_model(seed: int = 0, sharp: bool = False) -> Transformer:
    """The tiny model, seeded; ``sharp`` scales attention up so it is far from uniform and weighs in the
    logits (at init it barely does, which would hide a wrong rotary permutation)."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    if sharp:
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.wq.weight.mul_(20.0)
                layer.attention.wk.weight.mul_(20.0)
                layer.attention.wv.weight.mul_(5.0)
                layer.attention.wo.weight.mul_(5.0)
    return model


def save_dcp(model: Transformer, ckpt: Path) -> None:
    """A checkpoint laid out as training writes it: model under state_dict.model.*, plus optimizer state."""
    state = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "optimizer_0": {"state": {"model.norm.weight.exp_avg": torch.ones(ARGS.dim)}},
    }
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)


def hf_logits(path: Path) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def ours(model: Transformer) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


# ---- in-process --------------------------------------------------------------------------------
def test_export_gives_transformers_the_same_logits(tmp_path):
    model = seeded_model(sharp=True)
    save_dcp(model, tmp_path / "ckpt")
    out = export.main(
        [
            str(tmp_path / "ckpt"),
            str(tmp_path / "hf"),
            "--model",
            "llama3_debug",
            *TINY_MODEL,
            "--max-shard-size",
            "300KB",
        ]
    )
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ], files
    diff = (hf_logits(out) - ours(model)).abs().max().item()
    print(f"max |logits(HF) - logits(ours)| = {diff:.3g}")
    assert diff < 1e-5

    # Back through transformers' own writer (its config format, its file names) into our model.
    hf_model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_model.save_pretrained(str(tmp_path / "resaved"))
    hf.check_hf_dir(str(tmp_path / "resaved"), ARGS)
    back = seeded_model(seed=3)
    hf.load_hf_weights(back, str(tmp_path / "resaved"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.state_dict().items())

    # Sensitivity: the same weights without the q/k rotary permutation give other logits.
    unpermuted = {hf.to_hf_name(k): v for k, v in model.state_dict().items()}
    hf_model.load_state_dict(unpermuted)
    with torch.no_grad():
        wrong = (hf_model(TOKENS).logits - ours(model)).abs().max().item()
    print(f"without the q/k permutation: {wrong:.3g}")
    assert wrong > 1e-1


def test_config_json_matches_llama_config(tmp_path):
    cfg = hf.hf_config(ARGS)
    assert cfg["intermediate_size"] == ARGS.ffn_hidden_dim and cfg["num_key_value_heads"] == 2
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["tie_word_embeddings"] is False
    assert hf.config_mismatches(cfg, ARGS) == ({}, [], [])
    llama8b = get_flavor("llama3_8b")
    assert hf.hf_config(llama8b)["intermediate_size"] == 14336  # Meta's published width
    for published, start in (("llama3_70b", ARGS), ("llama3_405b", llama8b)):  # the named overrides do match
        config = hf.hf_config(get_flavor(published))
        fixes, _, _ = hf.config_mismatches(config, start)
        assert fixes and hf.config_mismatches(config, start.with_overrides(**fixes)) == ({}, [], [])


def test_permutation_round_trips():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(hf.half_to_interleaved(hf.interleaved_to_half(w, 4), 4), w)
    assert not torch.equal(hf.interleaved_to_half(w, 4), w)


def test_loads_into_a_pipeline_stage_and_tied_embeddings(tmp_path):
    source = seeded_model(0)
    save_dcp(source, tmp_path / "ckpt")
    out = export.main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--model", "llama3_debug", *TINY_MODEL])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # A pipeline stage: this model with parts removed, original names (see strategies/pipeline.py).
    stage = seeded_model(7)
    stage.tok_embeddings, stage.norm, stage.output = None, None, None
    del stage.layers["0"]
    hf.load_hf_weights(stage, str(out))
    expected = source.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in stage.state_dict().items())

    # Tied (Llama 3.2 1B/3B style): no lm_head in the file, the head reads the embedding.
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    hf.check_hf_dir(str(out), ARGS)
    target = seeded_model(7)
    hf.load_hf_weights(target, str(out))
    assert torch.equal(target.output.weight, source.tok_embeddings.weight)


def test_bad_hf_dirs_are_refused_before_training(tmp_path):
    def refused(path, error, *needles, model=TINY_MODEL):
        cfg = compose([*NOT_MODEL, *model, f"model.init_from_hf={path}"])
        with pytest.raises(error) as info:
            validate(cfg)
        assert all(n in str(info.value) for n in needles), str(info.value)

    refused(tmp_path / "missing", FileNotFoundError, "model.init_from_hf=", "is not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", FileNotFoundError, "config.json")
    save_dcp(seeded_model(), tmp_path / "ckpt")
    out = export.main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--model", "llama3_debug", *TINY_MODEL])
    other_shape = ["model.dim=128", "model.n_layers=3", *TINY_MODEL[2:]]
    refused(out, ConfigError, "model.dim=64 model.n_layers=2", model=other_shape)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    refused(out, ConfigError, "rope_theta=10000.0")
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    refused(out, FileNotFoundError, "no *.safetensors")


@pytest.mark.parametrize("case", ["missing", "incomplete", "no-config", "not-empty-out", "bad-dtype"])
def test_bad_export_inputs_exit_2_writing_nothing(tmp_path, capsys, case):
    ckpt, out = tmp_path / "run" / "checkpoints" / "step-000004", tmp_path / "hf"
    args = [str(ckpt), str(out)]
    if case != "missing":
        save_dcp(seeded_model(), ckpt)
    if case == "incomplete":  # shards written, .metadata never published
        (ckpt / ".metadata").unlink()
    if case == "not-empty-out":
        out.mkdir()
        (out / "keep.txt").write_text("x")
        args += ["--model", "llama3_debug", *TINY_MODEL]
    if case == "bad-dtype":
        args += ["--dtype", "fp8", "--model", "llama3_debug"]
    with pytest.raises(SystemExit) as info:
        export.main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lit-titan: error: ") and "\n" not in err and "Traceback" not in err, err
    assert {
        "missing": "does not exist",
        "incomplete": ".metadata",
        "no-config": "--model FLAVOR",
        "not-empty-out": "not empty",
        "bad-dtype": "--dtype",
    }[case] in err
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert not list(tmp_path.glob(".hf.partial*"))


# ---- real training runs ------------------------------------------------------------------------
COMMON = [*TINY, "seed=0", "precision=32-true"]


def newest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint directory (unpublished or damaged saves excluded)."""
    found = [
        p
        for p in (run_dir / "checkpoints").iterdir()
        if (p / ".metadata").is_file() and not p.name.endswith(".partial") and ".damaged" not in p.name
    ]
    return max(found, key=lambda p: p.stat().st_mtime)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, worlds):
    """A dp2 (FSDP) run from seeded random init, exported with the command line; reused below."""
    root = tmp_path_factory.mktemp("trained")
    worlds.train([*COMMON, "trainer.max_steps=4", "cluster.devices=2"], root / "run")
    proc = run_job(
        [sys.executable, "-m", "lit_titan.cli", "export", str(newest_checkpoint(root / "run")), str(root / "hf")],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.mark.slow
def test_trained_checkpoint_exports_and_round_trips_exactly(trained):
    hf_dir = trained / "hf"
    assert json.loads((hf_dir / "config.json").read_text())["hidden_size"] == 64  # from the run's config.yaml
    model = seeded_model(seed=123)
    hf.load_hf_weights(model, str(hf_dir))
    expected = final_params(trained / "run")
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[f"model.{name}"]), name
    assert (hf_logits(hf_dir) - ours(model)).abs().max() < 1e-5


@pytest.mark.slow
def test_init_from_hf_trains_the_same_under_fsdp_and_tp(trained, tmp_path, worlds):
    start = [*COMMON, "trainer.max_steps=3", "checkpoint.enabled=false", f"model.init_from_hf={trained / 'hf'}"]
    worlds.train([*start, "cluster.devices=4", "parallel.tp=2"], tmp_path / "dp2tp2")
    worlds.train([*start, "cluster.devices=1"], tmp_path / "single")
    assert_losses_match(losses(tmp_path / "dp2tp2"), losses(tmp_path / "single"), rtol=1e-5)
    # Same seed and data as the random-init run that produced the weights: a different first loss
    # shows the HF weights, not the seeded init, were trained.
    assert abs(losses(tmp_path / "single")[0] - losses(trained / "run")[0]) > 1e-3
