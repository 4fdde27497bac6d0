"""Hugging Face Qwen3-MoE interop: names, tensors and config of the Hub checkpoint format.

The Hub's ``Qwen/Qwen3-*-A*B`` safetensors hold one tensor per expert
(``model.layers.N.mlp.experts.E.gate_proj.weight``); ours stacks them (``moe.experts.w1`` [E, ...]),
so export splits and import stacks. transformers >= 5 fuses them again on load with its own
conversion, so a directory written here loads with ``Qwen3MoeForCausalLM.from_pretrained``.
Rotary layout, q/k norms and names otherwise map one to one. The aux-loss-free expert bias has no
HF counterpart and is not exported. Only safetensors are read or written (never pickle).
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
    if m.num_shared_experts or m.score_func != "softmax" or m.route_scale != 1.0 or m.bias_update_rate > 0:
        raise ValueError(
            "Qwen3-MoE on Hugging Face has softmax routing without shared experts, route scale "
            "or expert bias; export a model with those options off"
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
