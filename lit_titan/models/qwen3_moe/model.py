"""Qwen3-MoE as a plain nn.Module: no parallelism in here.

Kept to the contract the Llama model gives parallel code (models/llama3/model.py): blocks in an
``nn.ModuleDict`` keyed "0".."n-1"; ``tok_embeddings``/``norm``/``output`` may be ``None`` on a
pipeline stage; built on meta and filled by ``init_weights(seed)``; attention's core op is the
submodule ``attention.core``. Two differences from Llama, both Qwen3's: q and k are RMS-normalised
per head before the rotation, and the rotation pairs dim i with i + head_dim/2 (HF's
``rotate_half``), so HF weights load unpermuted.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lit_titan.models.init import InitFn, canonical_name, normal, ones, seeded_init_
from lit_titan.models.llama3.attention import attention_mask
from lit_titan.models.llama3.model import CoreAttention, OutputHead
from lit_titan.models.loss import at_least_fp32
from lit_titan.models.moe import MoE, SwiGLU, moe_aux_loss
from lit_titan.models.qwen3_moe.args import Qwen3MoEArgs


def rope_tables(args: Qwen3MoEArgs, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin [max_seq_len, head_dim // 2] in float32 (HF's default rope, no scaling)."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rotary_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [b, s, h, d] pairing dim i with i + d/2 by cos/sin [s|b,s, d/2]."""
    xf = at_least_fp32(x)
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen3MoEArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.core = CoreAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Any = None) -> Tensor:
        bs, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_half(q, cos, sin), apply_rotary_half(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); h + ffn(norm(h)), the FFN a MoE or (HF's dense layers) a SwiGLU."""

    def __init__(self, args: Qwen3MoEArgs, layer: int) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe(layer):
            self.moe: MoE | None = MoE(args.dim, args.moe)
            self.feed_forward: SwiGLU | None = None
        else:
            self.moe, self.feed_forward = None, SwiGLU(args.dim, args.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Any = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3MoE(nn.Module):
    def __init__(self, args: Qwen3MoEArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.tie_weights()
        cos, sin = rope_tables(args, device="meta" if torch.empty(0).device.type == "meta" else None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The last training forward's auxiliary loss (coefficient included), detached, for logging.
        self.last_aux_loss: Tensor | None = None
        self.last_aux_term: Tensor | None = None
        # Each layer's share of the mean over layers, when it back-propagates its own (pipeline stages).
        for m in self.moe_layers():
            m.num_moe_layers = len(self.moe_layers())

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if layer.moe is not None]

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        labels: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor:
        """As the Llama model's forward; with ``labels`` the loss includes the router's auxiliary loss.

        The auxiliary loss is added where the loss is made (this forward, with the head), from the
        statistics every MoE layer of this forward left behind. Inside ``losses_in_backward`` (a pipeline
        stage) each layer back-propagated its share itself and left none: the loss is the head's alone.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            cos, sin = self.rope_cos[: tokens.shape[1]], self.rope_sin[: tokens.shape[1]]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = None
        if documents is not None or self.args.attention != "sdpa":
            mask = attention_mask(self.args.attention, documents, tokens.shape[1], h.device)
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if labels is None:
            return self.output(h)
        loss = self.output(h, labels=labels)
        aux = moe_aux_loss(self.moe_layers())
        if aux is None:
            return loss
        self.last_aux_loss = aux.detach()
        self.last_aux_term = aux  # live: the step runner weighs it per micro-batch (take_aux_term)
        return loss + aux.to(loss.dtype)

    def tie_weights(self) -> None:
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    # ---- materialisation ------------------------------------------------------------------------
    def init_fn(self, name: str) -> InitFn:
        """The initialiser of one parameter by canonical name (TorchTitan's scheme, experts included)."""
        args = self.args
        if name.startswith("tok_embeddings."):
            return normal(args.dim**-0.5, trunc=3.0) if args.tie_embeddings else normal(1.0)
        if name.startswith("output."):
            return normal(args.dim**-0.5, trunc=3.0)
        if name.endswith("norm.weight"):
            return ones()
        if name.startswith("layers."):
            out_std = 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1))
            if name.endswith(("attention.wo.weight", ".w2.weight", ".w3.weight", "experts.w2", "experts.w3")):
                return normal(out_std, trunc=3.0)
            return normal(0.02, trunc=3.0)
        raise KeyError(f"no initialiser for parameter {name!r}")

    def init_buffers(self, device: torch.device | str) -> None:
        self.rope_cos, self.rope_sin = rope_tables(self.args, device=device)
        for m in self.moe_layers():
            m.expert_bias = torch.zeros(m.args.num_experts, dtype=torch.float32, device=device)
            m.tokens_per_expert = torch.zeros(m.args.num_experts, dtype=torch.float32, device=device)
            m.injected_aux = torch.zeros((), dtype=torch.float32, device=device)
            m.injected_forwards = torch.zeros((), dtype=torch.float32, device=device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """Fill every parameter (sharded or not) from (seed, name); rebuild the buffers."""
        self.tie_weights()
        for name, param in self.named_parameters():
            canon = canonical_name(name)
            seeded_init_(param, canon, seed, self.init_fn(canon))
        if buffer_device is None:
            buffer_device = next((p.device for p in self.parameters() if p.device.type != "meta"), "cpu")
        self.init_buffers(buffer_device)
