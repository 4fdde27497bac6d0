"""Llama 3.2: exact sizes, tied embeddings (kept tied under FSDP and TP, refused
under PP), the model.* config keys, and HF import/export checked against `transformers`."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import TINY, assert_losses_match, losses
from lit_titan.config import ConfigError, compose, validate
from lit_titan.config.spec import model_args
from lit_titan.models import hf_io
from lit_titan.models.llama3 import Transformer, get_flavor, hf
from lit_titan.models.llama3.args import RopeScaling

EXPECTED = {"llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824}
ROPE32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_counts_exact_and_tied(name):
    with torch.device("meta"):
        model = Transformer(get_flavor(name))
    assert sum(p.numel() for p in model.parameters()) == EXPECTED[name]
    assert model.output.weight is model.tok_embeddings.weight
    assert model.args.rope_scaling == ROPE32 and model.args.vocab_size == 128256


def test_config_keys_compose_and_null_scaling():
    cfg = compose(["model=llama3_2_1b", "model.norm_eps=1e-6", "model.rope_theta=10000", "model.rope_scaling=null"])
    args = model_args(cfg)
    assert (args.norm_eps, args.rope_theta, args.rope_scaling, args.tie_embeddings) == (1e-6, 10000.0, None, True)
    assert model_args(compose(["model=llama3_2_3b"])).rope_scaling == ROPE32
    assert model_args(compose(["model=llama3_8b"])).rope_scaling == RopeScaling()
    assert model_args(compose(["model=llama3_debug", "model.tie_embeddings=true"])).tie_embeddings


def test_tied_refused_under_pp_with_the_reason():
    cfg = compose([*TINY, "model.tie_embeddings=true", "cluster.devices=2", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="model.tie_embeddings=true: .* parallel.pp=2.*different ranks"):
        validate(cfg)


def _small(tie: bool, scaling: RopeScaling | None):
    return get_flavor(
        "llama3_debug",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=512,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=scaling,
        tie_embeddings=tie,
        max_seq_len=256,
    )


def _hf_config(args) -> LlamaConfig:
    c = hf.hf_config(args)
    c.pop("torch_dtype", None), c.pop("dtype", None), c.pop("architectures", None), c.pop("model_type", None)
    return LlamaConfig(**c)


TOKENS = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "tie, scaling",
    [(True, ROPE32), (True, None), (False, ROPE32)],
    ids=["tied-rope32", "tied-no-scaling", "untied-rope32"],
)
def test_hf_import_and_export_match_transformers_logits(tie, scaling, tmp_path):
    """A randomly initialised HF Llama of this shape (made here, no hub) -> our model: same logits;
    ours -> HF directory -> transformers: same logits, lm_head absent when tied."""
    args = _small(tie, scaling)
    torch.manual_seed(1)
    ref = LlamaForCausalLM(_hf_config(args)).eval()
    with torch.no_grad():  # sharpen attention so rotary layout and scaling weigh in the logits
        for layer in ref.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
    ref.save_pretrained(str(tmp_path / "ref"))
    assert ref.config.tie_word_embeddings is tie
    hf.check_hf_dir(str(tmp_path / "ref"), args)
    ours = Transformer(args)
    hf.load_hf_weights(ours, str(tmp_path / "ref"))
    ours.init_buffers("cpu")
    assert (ours.output.weight is ours.tok_embeddings.weight) is tie
    with torch.no_grad():
        want, got = ref(TOKENS).logits, ours(TOKENS)
    assert (got - want).abs().max().item() < 1e-4

    # Export: our state dict through hf.py, read back by transformers.
    from safetensors.torch import save_file

    out = tmp_path / "out"
    out.mkdir()
    save_file(dict(hf.iter_hf_tensors(ours.state_dict(), args, torch.float32)), str(out / hf_io.SINGLE_FILE))
    (out / hf_io.CONFIG_FILE).write_text(json.dumps(hf.hf_config(args)))
    from safetensors import safe_open

    with safe_open(str(out / hf_io.SINGLE_FILE), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tie
    back = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - want).abs().max().item() < 1e-4


def test_wrong_settings_name_their_overrides(tmp_path):
    args = _small(True, ROPE32)
    torch.manual_seed(1)
    LlamaForCausalLM(_hf_config(args)).save_pretrained(str(tmp_path / "ref"))
    with pytest.raises(ConfigError) as info:
        hf.check_hf_dir(str(tmp_path / "ref"), args.with_overrides(rope_scaling=None, norm_eps=1e-5, rope_theta=5e5))
    msg = str(info.value)
    assert (
        "model.norm_eps=1e-06" in msg
        and "model.rope_theta=10000.0" in msg
        and "model.rope_scaling={factor: 32.0" in msg
    )
    untied = _small(False, ROPE32)
    LlamaForCausalLM(_hf_config(untied)).save_pretrained(str(tmp_path / "untied"))
    with pytest.raises(ConfigError, match="model.tie_embeddings=false"):
        hf.check_hf_dir(str(tmp_path / "untied"), args)


# ---- tied under FSDP and TP: the same training as one process -----------------------------------
STEPS = 4
TIED = [*TINY, "model.tie_embeddings=true", f"trainer.max_steps={STEPS}", "seed=0", "precision=32-true"]


@pytest.mark.slow
def test_tied_trains_the_same_under_fsdp_x_tp(tmp_path, worlds):
    worlds.train([*TIED, "cluster.devices=1"], tmp_path / "one")
    worlds.train([*TIED, "cluster.devices=4", "parallel.tp=2"], tmp_path / "dp2tp2")
    assert_losses_match(losses(tmp_path / "dp2tp2"), losses(tmp_path / "one"), rtol=1e-5)
    from helpers import final_params

    one, par = final_params(tmp_path / "one"), final_params(tmp_path / "dp2tp2")
    assert one.keys() == par.keys()
    for name, ref in one.items():
        torch.testing.assert_close(par[name], ref, rtol=0, atol=1e-4, msg=name)
    emb, head = "model.tok_embeddings.weight", "model.output.weight"
    assert emb in par
    if head in par:  # a state dict lists the shared weight under both names: still one weight
        assert torch.equal(par[head], par[emb])


def test_materialised_from_meta_stays_tied():
    """What every strategy does: build on meta, ``to_empty``, ``init_weights`` (to_empty unties)."""
    with torch.device("meta"):
        model = Transformer(_small(True, ROPE32))
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("output.weight") == 0


def test_model_code_depends_on_nothing_above_it():
    """lit_titan.models imports only itself and the leaf modules errors, settings and models/loss.py
    (which import nothing from lit_titan), so config -> models never comes back up. The one
    exception is each family's parallel layout (parallelize.py), which registers a ParallelPlan, the data
    type the strategy reads (lit_titan.strategies.parallel_plan imports nothing from models), and the registry,
    which names that type."""
    import ast
    from pathlib import Path

    import lit_titan

    root = Path(lit_titan.__file__).parent
    # lit_titan.settings: setting(), how a family's arguments declare their config keys (a leaf module)
    allowed = ("lit_titan.models", "lit_titan.errors", "lit_titan.settings")
    for leaf in ("errors.py", "settings.py", "models/loss.py"):
        tree = ast.parse((root / leaf).read_text())
        assert not [
            n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("lit_titan")
        ]
    for path in (root / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            ok = (
                (*allowed, "lit_titan.strategies.parallel_plan")
                if path.name in ("parallelize.py", "registry.py")
                else allowed
            )
            bad = [n for n in names if n.startswith("lit_titan") and not n.startswith(ok)]
            assert not bad, f"{path.relative_to(root)} imports {bad}"
