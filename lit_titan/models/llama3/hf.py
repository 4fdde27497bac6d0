"""Hugging Face Llama adapter: names, rotary layout and ``config.json`` of a HF ``LlamaForCausalLM``.

The files themselves (safetensors shards, index, per-rank slices) are ``models/hf_io.py``'s job.

Two differences between our Llama and HF's besides the names:
- rotary embeddings: ours rotate consecutive pairs of each head's dims (Meta's complex layout),
  HF's ``rotate_half`` pairs dim i with dim i + head_dim/2. The q/k projections' output rows are
  permuted on export (as HF's ``convert_llama_weights_to_hf.py`` does) and back on import, which
  makes both models compute the same attention scores;
- the FFN width: HF stores ``intermediate_size``, we derive it from ``multiple_of`` and
  ``ffn_dim_multiplier``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lit_titan.errors import ConfigError
from lit_titan.models import hf_io
from lit_titan.models.hf_io import CONFIG_FILE
from lit_titan.models.init import canonical_name
from lit_titan.models.llama3.args import ModelArgs, RopeScaling

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_FROM_HF_TOP = {v: k for k, v in _TOP_LEVEL.items()}
_FROM_HF_LAYER = {v: k for k, v in _PER_LAYER.items()}


# ---- names and tensors ---------------------------------------------------------------------------
def to_hf_name(name: str) -> str:
    """Our parameter name (wrapper prefixes allowed) -> the HF ``LlamaForCausalLM`` name."""
    name = canonical_name(name)
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}"
    raise KeyError(f"parameter {name!r} has no Hugging Face Llama counterpart")


def from_hf_name(hf_name: str) -> str:
    """HF ``LlamaForCausalLM`` name -> ours."""
    if hf_name in _FROM_HF_TOP:
        return _FROM_HF_TOP[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _FROM_HF_LAYER:
        return f"layers.{parts[2]}.{_FROM_HF_LAYER[parts[3]]}"
    raise KeyError(f"Hugging Face tensor {hf_name!r} has no lit-titan Llama counterpart")


def interleaved_to_half(w: Tensor, n_heads: int) -> Tensor:
    """Rows of a q/k projection from Meta's pairwise rotary layout to HF's rotate_half layout.

    Within each head, output dims (0,1),(2,3),... become (0,d/2),(1,d/2+1),...
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of ``interleaved_to_half``: HF q/k rows back to our rotary layout."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rotary_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """Heads to permute over for a q/k projection (our name), None for every other tensor."""
    if name.endswith("attention.wq.weight"):
        return n_heads
    if name.endswith("attention.wk.weight"):
        return n_kv_heads
    return None


def to_hf_tensor(name: str, tensor: Tensor, args: ModelArgs) -> tuple[str, Tensor]:
    """One of our (full) parameters -> (HF name, HF tensor)."""
    heads = _rotary_heads(canonical_name(name), args.n_heads, args.kv_heads)
    return to_hf_name(name), tensor if heads is None else interleaved_to_half(tensor, heads)


def from_hf_tensor(hf_name: str, tensor: Tensor, n_heads: int, n_kv_heads: int) -> tuple[str, Tensor]:
    """One HF tensor -> (our name, our tensor)."""
    name = from_hf_name(hf_name)
    heads = _rotary_heads(name, n_heads, n_kv_heads)
    return name, tensor if heads is None else half_to_interleaved(tensor, heads)


def to_hf_state_dict(state_dict: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Our full state dict -> HF's (names and q/k permutation); a tied head is not stored (HF ties it)."""
    return dict(to_hf_tensor(k, v, args) for k, v in state_dict.items() if not _tied_head(k, args))


def _tied_head(name: str, args: ModelArgs) -> bool:
    return args.tie_embeddings and canonical_name(name) == "output.weight"


# ---- config.json ---------------------------------------------------------------------------------
def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``LlamaConfig``-compatible config.json for ``args``.

    Rotary settings use the legacy ``rope_theta`` / ``rope_scaling`` keys, which every
    transformers version reads (v5 converts them to ``rope_parameters``).
    """
    dtype_name = hf_io.DTYPE_NAMES[dtype]
    rope_scaling = None
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name,  # transformers < 5
        "dtype": dtype_name,  # transformers >= 5
    }


def _hf_rope(config: dict[str, Any]) -> tuple[float | None, RopeScaling | None, str | None]:
    """(rope_theta, llama3 scaling, unsupported rope type) from either config generation."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = config.get("rope_theta", params.get("rope_theta"))
    if not scaling:
        return theta, None, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        return theta, None, str(kind)
    return (
        theta,
        RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        ),
        None,
    )


def _ffn_overrides(dim: int, intermediate: int, args: ModelArgs) -> dict[str, Any]:
    """model.multiple_of / model.ffn_dim_multiplier that give an FFN width of ``intermediate``."""
    trial = args.with_overrides(dim=dim, multiple_of=intermediate)
    if trial.ffn_hidden_dim == intermediate:
        return {"multiple_of": intermediate}
    base = int(2 * (4 * dim) / 3)
    mult = math.floor(intermediate / base * 1e6) / 1e6  # rounded down: int(mult * base) <= intermediate
    trial = args.with_overrides(dim=dim, multiple_of=intermediate, ffn_dim_multiplier=mult)
    if trial.ffn_hidden_dim == intermediate:
        return {"multiple_of": intermediate, "ffn_dim_multiplier": mult}
    return {"multiple_of": f"<value giving FFN width {intermediate}>"}


def config_mismatches(config: dict[str, Any], args: ModelArgs) -> tuple[dict[str, Any], list[str], list[str]]:
    """Differences between a HF config.json and ``args``.

    Returns (``model.KEY`` overrides that fix them, differences in values that have no override
    (a rotary type other than Llama 3's), features lit-titan's Llama lacks).
    """
    fixes: dict[str, Any] = {}
    problems: list[str] = []
    heads = int(config["num_attention_heads"])
    wanted = {
        "vocab_size": int(config["vocab_size"]),
        "dim": int(config["hidden_size"]),
        "n_layers": int(config["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or heads),
    }
    current = {
        "vocab_size": args.vocab_size,
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
    }
    fixes.update({k: v for k, v in wanted.items() if current[k] != v})
    # A tied file loads into an untied model (the head starts as a copy of the embedding), but one
    # weight cannot hold a file's two different ones.
    if args.tie_embeddings and not config.get("tie_word_embeddings", False):
        fixes["tie_embeddings"] = "false"
    intermediate = int(config["intermediate_size"])
    if args.with_overrides(dim=wanted["dim"]).ffn_hidden_dim != intermediate:
        fixes.update(_ffn_overrides(wanted["dim"], intermediate, args))
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != wanted["dim"] // heads:
        problems.append(f"head_dim={head_dim} differs from hidden_size/num_attention_heads (unsupported)")
    if config.get("model_type", "llama") != "llama":
        problems.append(f"model_type={config.get('model_type')!r} is not 'llama'")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.get('hidden_act')!r} is not 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{key}=true (lit-titan's Llama has no biases)")
    numeric, no_override = _numeric_fixes(config, args)
    fixes.update(numeric)
    return fixes, no_override, problems


def _numeric_fixes(config: dict[str, Any], args: ModelArgs) -> tuple[dict[str, Any], list[str]]:
    """(``model.*`` overrides for norm eps and rotary settings, a rotary type we lack)."""
    fixes: dict[str, Any] = {}
    eps = config.get("rms_norm_eps")
    if eps is not None and not math.isclose(float(eps), args.norm_eps, rel_tol=1e-9):
        fixes["norm_eps"] = float(eps)
    theta, scaling, unsupported = _hf_rope(config)
    if theta is not None and not math.isclose(float(theta), args.rope_theta, rel_tol=1e-9):
        fixes["rope_theta"] = float(theta)
    if unsupported:
        return fixes, [f"rope type {unsupported!r} (only Llama 3's 'llama3' scaling or none is supported)"]
    if scaling != args.rope_scaling:
        fixes["rope_scaling"] = (
            "null" if scaling is None else ("{" + ", ".join(f"{k}: {v}" for k, v in asdict(scaling).items()) + "}")
        )
    return fixes, []


# ---- the directory -------------------------------------------------------------------------------
def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, in the model's order (embedding, layers, norm, head)."""
    from lit_titan.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _tied_source(hf_name: str, available: dict[str, Any], config: dict[str, Any]) -> str:
    """The HF tensor to read for ``hf_name``: tied models store no lm_head (Llama 3.2 1B/3B)."""
    if hf_name == "lm_head.weight" and hf_name not in available and config.get("tie_word_embeddings"):
        return "model.embed_tokens.weight"
    return hf_name


def check_hf_expressible(args: ModelArgs, where: str) -> None:
    """ConfigError when ``args`` has no Hugging Face Llama equivalent (its weights would load into a different model)."""
    if args.parallel_block:
        raise ConfigError(
            f"{where}: model.parallel_block=true has no Hugging Face Llama equivalent (HF's block is "
            f"sequential, with two norms); set model.parallel_block=false"
        )
    if args.mup and args.width_multiplier != 1.0:
        raise ConfigError(
            f"{where}: model.mup=true with model.mup_base_width={args.mup_base_width} != model.dim={args.dim} "
            f"scales logits and attention, which Hugging Face Llama does not; set model.mup=false"
        )
    if args.sliding_window is not None:
        raise ConfigError(
            f"{where}: model.sliding_window={args.sliding_window} has no Hugging Face Llama equivalent "
            f"(LlamaConfig attends to every earlier token); set model.sliding_window=null"
        )


def export_note(args: ModelArgs) -> None:
    """Nothing of a Llama is left out of an export (what is not expressible is refused above)."""
    return None


def import_note(args: ModelArgs) -> None:
    """Nothing of a Llama starts other than from the HF directory."""
    return None


def check_hf_dir(path: str, args: ModelArgs) -> None:
    """Refuse a HF directory that is missing or does not match ``args``, before any process starts.

    Raises FileNotFoundError (missing directory, config or weights) or ``ConfigError`` (from
    ``lit_titan.errors``, re-exported by ``lit_titan.config``) naming the ``model.*`` overrides that
    would match it.
    """
    where = f"model.init_from_hf={path}"
    check_hf_expressible(args, where)
    root = Path(path).expanduser()
    hint = (
        "point it at a Hugging Face Llama directory (config.json + *.safetensors), e.g. written by "
        "`lit-titan export CHECKPOINT OUT_DIR`"
    )
    if not root.is_dir():
        raise FileNotFoundError(f"{where} is not a directory; {hint}")
    if not (root / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{where} has no {CONFIG_FILE}; {hint}")
    try:
        config = hf_io.read_config(root)
        fixes, no_override, unsupported = config_mismatches(config, args)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{where}: unreadable {CONFIG_FILE} ({type(err).__name__}: {err})") from err
    if unsupported:
        raise ConfigError(f"{where} is not a Llama that lit-titan can load: {'; '.join(unsupported)}")
    if fixes or no_override:
        parts = []
        if fixes:
            parts.append(f"set {' '.join(f'model.{k}={v}' for k, v in fixes.items())}")
        if no_override:
            parts.append(
                f"{'; '.join(no_override)} have no model.* override: choose a flavor (model=...) with these values"
            )
        raise ConfigError(f"{where} does not match the chosen model: {'; and '.join(parts)}")
    _check_weights(root, args, config, where, hint)


def _check_weights(root: Path, args: ModelArgs, config: dict[str, Any], where: str, hint: str) -> None:
    """Every tensor the model needs is present, in an existing file, with the right shape."""
    files = hf_io.check_weight_files(root, where, hint)
    sources = {
        to_hf_name(ours): (_tied_source(to_hf_name(ours), files, config), shape)
        for ours, shape in param_shapes(args).items()
    }
    absent = [name for name, (source, _) in sources.items() if source not in files]
    if absent:
        raise FileNotFoundError(f"{where} lacks tensors {absent[:4]}{' ...' if len(absent) > 4 else ''}; {hint}")
    got = hf_io.tensor_shapes(files, {source for source, _ in sources.values()})
    wrong = [
        f"{source} {list(got[source])} (expected {list(shape)})"
        for source, shape in sources.values()
        if got[source] != shape
    ]
    if wrong:
        raise ConfigError(f"{where}: tensor shapes do not match its config.json: {'; '.join(wrong[:4])}")


# ---- loading into a (sharded) model --------------------------------------------------------------
def load_hf_weights(model: nn.Module, path: str) -> None:
    """Copy a HF Llama directory into ``model`` (plain, FSDP/TP DTensors or a PP stage, which holds its
    layers under their original names); each rank reads only its slices (``hf_io.load_into``)."""
    root = Path(path).expanduser()
    config = hf_io.read_config(root)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)

    def reader(name: str) -> hf_io.BlockReader:
        rotary = _rotary_heads(canonical_name(name), heads, kv_heads)
        if rotary is None:
            return hf_io.read_block
        return lambda tensor_slice, offsets, sizes: read_region(tensor_slice, offsets, sizes, rotary)

    hf_io.load_into(model, root, lambda name, files: _tied_source(to_hf_name(name), files, config), reader)


def read_region(
    tensor_slice: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], rotary_heads: int | None = None
) -> Tensor:
    """Our rows/columns ``offsets:offsets+sizes`` of one HF tensor, reading only that block.

    q/k projections (``rotary_heads``) are stored in HF's rotary layout, a permutation of the rows
    within each head: the whole heads that overlap the block are read, un-permuted, then cut.
    """
    if rotary_heads is None:
        return hf_io.read_block(tensor_slice, offsets, sizes)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    head_dim = int(tensor_slice.get_shape()[0]) // rotary_heads
    first, stop = offsets[0] // head_dim, -(-(offsets[0] + sizes[0]) // head_dim)
    block = tensor_slice[(slice(first * head_dim, stop * head_dim), *index[1:])]
    start = offsets[0] - first * head_dim
    return half_to_interleaved(block, stop - first)[start : start + sizes[0]]


# ---- writing -------------------------------------------------------------------------------------
def iter_hf_tensors(state_dict: dict[str, Tensor], args: ModelArgs, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """(HF name, contiguous tensor in ``dtype``) for each of our full parameters."""
    for name, tensor in state_dict.items():
        if _tied_head(name, args):
            continue
        hf_name, hf_tensor = to_hf_tensor(name, tensor, args)
        yield hf_name, hf_tensor.to(dtype).contiguous()
