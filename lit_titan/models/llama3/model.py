"""Llama 3.1 / 3.2 as a plain nn.Module: no parallelism in here.

Parallel code elsewhere relies on three properties of this file:
- blocks live in an ``nn.ModuleDict`` keyed "0".."n-1", and ``tok_embeddings``, ``norm`` and
  ``output`` may be ``None``, so a pipeline stage is this model with parts removed and keeps the
  original parameter names;
- the model is built on the meta device and materialised by ``init_weights(seed)``, which gives
  the same values whatever the layout (see ``lit_titan.models.init``);
- attention's core op is a submodule (``attention.core``) that context parallelism can replace.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_titan.models.init import InitFn, canonical_name, normal, ones, seeded_init_
from lit_titan.models.llama3.args import ModelArgs, RopeScaling
from lit_titan.models.llama3.attention import attention, attention_mask, window_mask
from lit_titan.models.loss import at_least_fp32, chunked_cross_entropy


def scaled_rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies of rotary embeddings with Llama 3.1's long-context scaling.

    Wavelengths shorter than original_ctx/high_freq_factor keep their frequency, those longer than
    original_ctx/low_freq_factor are divided by ``factor``, and the band between is interpolated.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelen < high_wavelen, inv_freq, scaled)


def rope_tables(args: ModelArgs, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [max_seq_len, head_dim // 2], in float32."""
    inv_freq = scaled_rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    positions = torch.arange(args.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs (Meta's layout) of x [b, s, h, d] by angles cos/sin [s|b,s, d/2]."""
    pairs = at_least_fp32(x).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs.unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class CoreAttention(nn.Module):
    """Causal grouped-query attention: q [b, heads, s, d], k/v [b, kv_heads, s, d].

    Goes through the one entry point (``attention.attention``): SDPA with ``enable_gqa`` (torch
    >= 2.5), so K/V are never copied to query-head width nor saved for backward at that width, or
    FlexAttention with a block mask (``model.attention=flex``, document masking). A module, so
    context parallelism can swap it and communicate kv_heads too.
    """

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        # sliding window (None: full causal); read by context parallelism when it swaps this module
        self.window = window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
        if mask is None and self.window is not None:  # the model passes a mask only for documents / flex
            mask = window_mask(q.shape[2], self.window, q.device)
        return attention(q, k, v, mask)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None = None) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        # muP's attention scale sqrt(d_base)/d instead of 1/sqrt(d) (d: head dim, n_heads fixed across widths),
        # applied to q so that every attention core (SDPA, flex, context parallelism's) keeps its default
        self.q_scale = args.width_multiplier**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = CoreAttention(window)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Any = None) -> Tensor:
        bs, seqlen, _ = x.shape
        # -1, not n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # No mask argument for plain causal attention: context parallelism's core takes (q, k, v).
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Junction(nn.Identity):
    """A named point in a block where tensor parallelism changes a layout (identity without TP).

    The parallel block has two: ``fork`` (the normalised input both branches read: gathered once)
    and ``join`` (the sum of both branches' partial outputs: reduced once). Parameter-free, so
    checkpoints and weights do not change.
    """


class TransformerBlock(nn.Module):
    """Pre-norm block; with ``args.parallel_block`` the GPT-J/PaLM form ``x + attn(n) + mlp(n)``, n = norm(x).

    The parallel form has one norm (``attention_norm``) and no ``ffn_norm``; under TP the two
    row-parallel outputs are added while still partial sums, so one reduction serves both.
    """

    def __init__(self, args: ModelArgs, window: int | None = None) -> None:
        super().__init__()
        self.parallel = args.parallel_block
        self.attention = Attention(args, window)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if self.parallel:
            self.fork, self.join = Junction(), Junction()
        else:
            self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Any = None) -> Tensor:
        # mask as a keyword: TP's PrepareModuleInput maps the positional (x, cos, sin) only.
        if self.parallel:
            n = self.fork(self.attention_norm(x))
            return x + self.join(self.attention(n, cos, sin, mask=mask) + self.feed_forward(n))
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputHead(nn.Linear):
    """The LM head: logits, or (given labels) the mean next-token loss computed in token chunks.

    Computing the loss inside the head's own forward keeps one module call per step, so FSDP
    gathers the weight once and TP's style wraps the whole loss; ``chunk_tokens`` (0: off) is a
    setting of the run, not of the architecture (``loss.chunk_tokens``).
    """

    def __init__(self, dim: int, vocab_size: int, logit_scale: float = 1.0) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.chunk_tokens = 0
        # muP's output multiplier 1/m, applied to the input (W (h/m) = (W h)/m), so the chunked loss and
        # loss-parallel TP see ordinary logits of a scaled input
        self.logit_scale = logit_scale

    def forward(self, h: Tensor, labels: Tensor | None = None) -> Tensor:
        if self.logit_scale != 1.0:
            h = h * self.logit_scale
        if labels is None:
            return super().forward(h)
        if self.chunk_tokens > 0:
            return chunked_cross_entropy(h, self.weight, labels, self.chunk_tokens)
        return F.cross_entropy(at_least_fp32(super().forward(h).flatten(0, -2)), labels.flatten())


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, args.window_of(i)) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size, 1 / args.width_multiplier)
        if args.tie_embeddings:
            self.tie_weights()
        # Not persistent: derived from args, so checkpoints hold only learned weights.
        cos, sin = rope_tables(args, device="meta" if _on_meta() else None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        labels: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] on a pipeline stage without the embedding).

        ``positions`` ([s] or [b, s]) are the tokens' places in the original sequence; they default
        to 0..s-1 and differ when the sequence is split (context parallelism) or restart per
        document. With ``labels`` [b, s] the model with the head returns the mean next-token loss
        (chunked per ``output.chunk_tokens``) instead of logits, so full logits need never exist.
        ``documents`` [b, s] (document index per token) makes attention block-causal: no token
        attends across a document boundary.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            cos, sin = self.rope_cos[: tokens.shape[1]], self.rope_sin[: tokens.shape[1]]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        masks: dict[int | None, Any] = {}  # one per distinct window; plain causal and windowed SDPA need none here
        if documents is not None or self.args.attention != "sdpa":
            windows = {self.args.window_of(int(k)) for k in self.layers}
            masks = {
                w: attention_mask(self.args.attention, documents, tokens.shape[1], h.device, window=w) for w in windows
            }
        for key, layer in self.layers.items():
            mask = masks.get(self.args.window_of(int(key)))
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return self.output(h) if labels is None else self.output(h, labels=labels)

    def tie_weights(self) -> None:
        """Make the head use the embedding's weight (``args.tie_embeddings``).

        Called again by tensor parallelism after it replaced both with DTensors: the embedding
        (RowwiseParallel) and the head (ColwiseParallel) shard the [vocab, dim] weight the same way,
        ``Shard(0)``, so one DTensor serves both.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    # ---- materialisation ------------------------------------------------------------------------
    def init_fn(self, name: str) -> InitFn:
        """The initialiser of one parameter, by its canonical name (TorchTitan's scheme).

        Under muP (``args.mup``) with m = dim / mup_base_width: hidden matrices' std times m^-1/2 (variance
        1/fan_in), the head's std that of the base width (its logits are divided by m instead): muP
        paper's Table 3 in the multiplier form of the ``mup`` package's ``MuReadout``. At m = 1 this is
        the standard parametrisation.
        """
        args = self.args
        head_width = args.mup_base_width if args.mup else args.dim
        if name.startswith("tok_embeddings."):
            # Tied, it is also the head: the head's scale keeps the initial logits O(1).
            return normal(head_width**-0.5, trunc=3.0) if args.tie_embeddings else normal(1.0)
        if name.startswith("output."):
            return normal(head_width**-0.5, trunc=3.0)
        if name.endswith("norm.weight"):
            return ones()
        if name.startswith("layers."):
            layer_id = int(name.split(".")[1])
            depth = layer_id + 1 if args.depth_init else args.n_layers
            hidden = args.width_multiplier**-0.5
            out_std = hidden * 0.02 / math.sqrt(2 * depth)
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
                return normal(out_std, trunc=3.0)
            return normal(hidden * 0.02, trunc=3.0)
        raise KeyError(f"no initialiser for parameter {name!r}")

    def init_buffers(self, device: torch.device | str) -> None:
        cos, sin = rope_tables(self.args, device=device)
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """Fill every parameter (sharded or not) from (seed, name) and rebuild the rope tables."""
        # ``to_empty`` (meta -> device) gives each module a new Parameter, which unties shared weights.
        self.tie_weights()
        for name, param in self.named_parameters():
            canon = canonical_name(name)
            seeded_init_(param, canon, seed, self.init_fn(canon))
        if buffer_device is None:
            buffer_device = next((b.device for b in self.buffers() if b.device.type != "meta"), None)
            if buffer_device is None:
                buffer_device = _param_device(self)
        self.init_buffers(buffer_device)


def _on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def _param_device(module: nn.Module) -> torch.device:
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")
