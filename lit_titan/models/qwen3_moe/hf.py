"""Hugging Face Qwen3-MoE interop: names, tensors and config of the Hub checkpoint format.

The Hub's ``Qwen/Qwen3-*-A*B`` safetensors hold one tensor per expert
(``model.layers.N.mlp.experts.E.gate_proj.weight``); ours stacks them (``moe.experts.w1`` [E, ...]),
so export splits and import stacks. transformers >= 5 fuses them again on load with its own
conversion, so a directory written here loads with ``Qwen3MoeForCausalLM.from_pretrained``.
Rotary layout, q/k norms and names otherwise map one to one. The aux-loss-free expert bias
(``model.moe.bias_update_rate > 0``) has no HF counterpart: export leaves it out and ``init_from_hf``
starts it at 0, each saying so in one line (``export_note``, ``import_note``). Only safetensors are
read or written (never pickle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lit_titan.models.init import canonical_name
from lit_titan.models.qwen3_moe.args import Qwen3MoEArgs

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
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
}
_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_FROM_HF_LAYER = {v: k for k, v in _PER_LAYER.items()}
_FROM_HF_EXPERT = {v: k for k, v in _EXPERTS.items()}
NOT_EXPORTED = ("moe.expert_bias",)


def to_hf_state_dict(state_dict: dict[str, Tensor], args: Qwen3MoEArgs) -> dict[str, Tensor]:
    """Our (full, unsharded) state dict -> Hub-format tensors (experts split one per key)."""
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        name = canonical_name(name)
        if name in _TOP_LEVEL:
            if not (name == "output.weight" and args.tie_embeddings):
                out[_TOP_LEVEL[name]] = t
            continue
        _, layer, rest = name.split(".", 2)
        if rest.endswith(NOT_EXPORTED):
            continue
        prefix = f"model.layers.{layer}."
        if rest in _EXPERTS:
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.{_EXPERTS[rest]}.weight"] = t[e]
        else:
            out[prefix + _PER_LAYER[rest]] = t
    return out


def from_hf_state_dict(hf: dict[str, Tensor], args: Qwen3MoEArgs) -> dict[str, Tensor]:
    """Hub-format tensors -> our state dict (experts stacked); unknown names raise KeyError."""
    from_top = {v: k for k, v in _TOP_LEVEL.items()}
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    for hf_name, t in hf.items():
        if hf_name in from_top:
            out[from_top[hf_name]] = t
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault((layer, _FROM_HF_EXPERT[proj]), {})[int(e)] = t
        else:
            out[f"layers.{layer}.{_FROM_HF_LAYER[rest]}"] = t
    for (layer, ours), per_expert in experts.items():
        out[f"layers.{layer}.{ours}"] = torch.stack([per_expert[e] for e in range(args.moe.num_experts)])
    if args.tie_embeddings:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def hf_config(args: Qwen3MoEArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of a ``Qwen3MoeForCausalLM`` with these shapes (shared experts/sigmoid have none)."""
    m = args.moe
    if m.num_shared_experts or m.score_func != "softmax" or m.route_scale != 1.0:
        raise ValueError(
            "Qwen3-MoE on Hugging Face has softmax routing without shared experts or route scale; "
            "export a model with those options off"
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.ffn_dim,
        "moe_intermediate_size": m.hidden_dim,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk_prob,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": m.aux_loss_coef > 0,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": False,
    }


def save_hf(
    state_dict: dict[str, Tensor], args: Qwen3MoEArgs, out: str | Path, dtype: torch.dtype = torch.float32
) -> None:
    """Write ``config.json`` and one ``model.safetensors`` (small models; the sharded writer is the export command's)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2))
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in to_hf_state_dict(state_dict, args).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# ---- the registry's HFAdapter (models/registry.py): init_from_hf and `lit-titan export` ------------------
def check_hf_expressible(args: Qwen3MoEArgs, where: str) -> None:
    """ConfigError (one line) for options Hugging Face's Qwen3-MoE cannot hold (shared experts, sigmoid scores, ...)."""
    from lit_titan.errors import ConfigError

    try:
        hf_config(args)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def export_note(args: Qwen3MoEArgs) -> str | None:
    """What an export leaves out, in one line: the expert bias only steers which experts are chosen,
    and HF's router has no place for it, so dropping it keeps every weight exact."""
    rate = args.moe.bias_update_rate
    if rate <= 0:
        return None
    return (
        f"model.moe.bias_update_rate={rate}: the expert bias is not exported (Hugging Face Qwen3-MoE has none; "
        f"it selects experts by the router's scores alone)"
    )


def import_note(args: Qwen3MoEArgs) -> str | None:
    """What ``init_from_hf`` cannot take from a HF directory, in one line: the expert bias starts at 0."""
    rate = args.moe.bias_update_rate
    if rate <= 0:
        return None
    return f"model.moe.bias_update_rate={rate}: the expert bias starts at 0 (a Hugging Face Qwen3-MoE has none)"


def _hf_name(name: str) -> str:
    """Our canonical parameter name -> its HF name (experts: the stacked name, split by the callers)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_PER_LAYER[rest]}"


def param_shapes(args: Qwen3MoEArgs) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a model of ``args`` (computed on the meta device)."""
    from lit_titan.models.qwen3_moe.model import Qwen3MoE

    with torch.device("meta"):
        model = Qwen3MoE(args)
    return {k: tuple(v.shape) for k, v in to_hf_state_dict(dict(model.named_parameters()), args).items()}


def check_hf_dir(path: str, args: Qwen3MoEArgs) -> None:
    """Refuse a HF directory that is missing or does not match ``args``, before any process starts."""
    from lit_titan.errors import ConfigError
    from lit_titan.models import hf_io

    where = f"model.init_from_hf={path}"
    check_hf_expressible(args, where)
    root = Path(path).expanduser()
    hint = "point it at a Hugging Face Qwen3-MoE directory (config.json + *.safetensors)"
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{where} has no config.json; {hint}")
    config = hf_io.read_config(root)
    ours = hf_config(args)
    keys = {
        "hidden_size": "dim",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "head_dim": "head_dim",
        "vocab_size": "vocab_size",
        "intermediate_size": "ffn_dim",
        "moe_intermediate_size": "moe.hidden_dim",
        "num_experts": "moe.num_experts",
        "num_experts_per_tok": "moe.top_k",
        "decoder_sparse_step": "decoder_sparse_step",
    }
    wrong = [f"model.{k}={config[hf]}" for hf, k in keys.items() if hf in config and config[hf] != ours[hf]]
    if wrong:
        raise ConfigError(f"{where} does not match the chosen model: set {' '.join(wrong)}")
    files = hf_io.check_weight_files(root, where, hint)
    shapes = param_shapes(args)
    absent = [n for n in shapes if n not in files]
    if absent:
        raise FileNotFoundError(f"{where} lacks tensors {absent[:4]}; {hint}")


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, path: str) -> None:
    """Copy a HF Qwen3-MoE directory into ``model`` (plain or FSDP DTensors): each rank reads only its block;
    a stacked expert weight is assembled from the per-expert tensors of the experts its shard holds."""
    from safetensors import safe_open

    from lit_titan.models import hf_io

    files = hf_io.weight_files(Path(path).expanduser())
    opened: dict[Path, Any] = {}

    def stored(hf_name: str) -> Any:
        if hf_name not in files:
            raise KeyError(f"{path} lacks tensor {hf_name}")
        if files[hf_name] not in opened:
            opened[files[hf_name]] = safe_open(str(files[hf_name]), framework="pt")
        return opened[files[hf_name]].get_slice(hf_name)

    for name, param in model.named_parameters():
        canon = canonical_name(name)
        _, _, rest = canon.partition(".")
        rest = rest.partition(".")[2]
        if rest in _EXPERTS:
            layer = canon.split(".")[1]
            local = param.to_local() if hasattr(param, "to_local") else param
            offsets, sizes = hf_io.local_region(param)
            if local.numel():
                blocks = [
                    hf_io.read_block(
                        stored(f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[rest]}.weight"), offsets[1:], sizes[1:]
                    )
                    for e in range(offsets[0], offsets[0] + sizes[0])
                ]
                local.copy_(torch.stack(blocks))
            continue
        hf_name = _hf_name(canon)
        if hf_name == "lm_head.weight" and hf_name not in files:  # tied on the Hub: the embedding
            hf_name = "model.embed_tokens.weight"
        hf_io.copy_local_into(param, stored(hf_name), name)


def iter_hf_tensors(state_dict: dict[str, Tensor], args: Qwen3MoEArgs, dtype: torch.dtype) -> Any:
    """(HF name, contiguous tensor in ``dtype``) for each of our full parameters (experts split)."""
    for hf_name, tensor in to_hf_state_dict(state_dict, args).items():
        yield hf_name, tensor.detach().to(dtype).contiguous()
