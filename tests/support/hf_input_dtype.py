"""transformers' Llama and Qwen3-MoE computing in the input's dtype, for the fp64 reference tests.

Why: transformers computes RMSNorm, the attention softmax, the router softmax, the load-balancing sums and the
causal-LM loss in fp32 whatever the model's dtype, so an fp64 comparison with it bottoms out at fp32 round-off
(~1e-7) and its bounds sat at 1e-5. ``in_input_dtype(monkeypatch)`` swaps in copies of those five functions with
only the dtype changed (the formulas and their order are transformers' own: in fp32 they give its numbers, which
``tests/unit/models/test_qwen3_moe.py`` checks), for one test. Kept apart from the test modules so the worlds'
ranks never import transformers; nothing outside a test is patched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.loss import loss_utils
from transformers.models.llama import modeling_llama
from transformers.models.qwen3_moe import modeling_qwen3_moe

__all__ = ["in_input_dtype"]


def rms_norm(self: Any, hidden_states: Tensor) -> Tensor:
    """``LlamaRMSNorm.forward`` / ``Qwen3MoeRMSNorm.forward`` without the round trip through fp32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def eager_attention(modeling: Any) -> Any:
    """The module's ``eager_attention_forward`` with its softmax in the query's dtype."""

    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = modeling.repeat_kv(key, module.num_key_value_groups)
        value_states = modeling.repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=query.dtype)
        attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return attn_output, attn_weights

    return forward


def router(self: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``Qwen3MoeTopKRouter.forward`` with its softmax in the logits' dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dtype=router_logits.dtype, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def load_balancing(gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Any = None):
    """``load_balancing_loss_func`` (no attention mask: the tests pass none) summing in the logits' dtype."""
    assert attention_mask is None, "the shim covers the unmasked branch only"
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    dtype = gate_logits[0].dtype
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=dtype)
    router_prob_sum = torch.zeros(num_experts, dtype=dtype)
    total_rows = 0.0
    for layer_gate in gate_logits:
        routing_weights = F.softmax(layer_gate, dim=-1)
        _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
        tokens_per_expert_sum = tokens_per_expert_sum + torch.histc(
            selected_experts.reshape(-1).to(dtype), bins=num_experts, min=0, max=num_experts
        )
        router_prob_sum = router_prob_sum + routing_weights.sum(dim=0)
        total_rows = total_rows + routing_weights.shape[0]
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, ignore_index: int = -100, **kwargs: Any) -> Tensor:
    """``ForCausalLMLoss`` (mean over the shifted labels) without its upcast to fp32."""
    assert kwargs.get("num_items_in_batch") is None and kwargs.get("shift_labels") is None, kwargs
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index)


def in_input_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the calling test only: transformers' Llama and Qwen3-MoE compute RMSNorm, both softmaxes, the
    balancing sums and the causal-LM loss in the input's dtype."""
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", rms_norm)
    for modeling in (modeling_llama, modeling_qwen3_moe):
        monkeypatch.setattr(modeling, "eager_attention_forward", eager_attention(modeling))
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", router)
    monkeypatch.setattr(modeling_qwen3_moe, "load_balancing_loss_func", load_balancing)
    monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", causal_lm_loss)
