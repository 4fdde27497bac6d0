"""Chunked cross-entropy: the output projection, log-softmax and NLL per chunk of tokens.

At Llama 3's 128,256-token vocabulary the fp32 logits of 8,192 tokens are 4 GiB, and an
unchunked loss keeps them (or their log-softmax) for backward and then allocates their
gradient. Here each chunk of ``chunk_tokens`` tokens is projected, reduced to a summed NLL and
dropped; backward recomputes that chunk's logits (``torch.utils.checkpoint``) and frees them
before the next chunk, so at most one chunk's logits and their gradient exist at a time.

Works on plain tensors and on DTensors: under tensor parallelism with loss parallel the weight
is vocab-sharded (``Shard(0)``), each chunk's logits come out ``Shard(-1)`` and
``F.cross_entropy`` inside torch's ``loss_parallel()`` context reduces over the shards (the
strategy holds that context around both forward and backward). Imports nothing from lit_titan,
so model code may use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Vocabularies at least this large get a chunked loss by default (``loss.chunk_tokens=auto``):
# below it the logits are small next to the activations and recomputing the head is not worth it.
AUTO_MIN_VOCAB = 32768
AUTO_CHUNK_TOKENS = 1024


def resolve_chunk_tokens(setting: int | str | None, vocab_size: int) -> int:
    """``loss.chunk_tokens``: ``auto`` (1024 tokens when vocab >= 32K, else off), 0/None (off) or N."""
    if setting in (None, "auto"):
        return AUTO_CHUNK_TOKENS if vocab_size >= AUTO_MIN_VOCAB else 0
    if isinstance(setting, str) and not setting.isdigit():
        raise ValueError(f"loss.chunk_tokens={setting!r} must be auto, 0 (off) or a positive number of tokens")
    value = int(setting)
    if value < 0:
        raise ValueError(f"loss.chunk_tokens={value} must be auto, 0 (off) or a positive number of tokens")
    return value


def at_least_fp32(t: Tensor) -> Tensor:
    """``t`` in float32 when narrower (bf16/fp16 logits, rotary inputs); float64 stays float64, so an
    fp64 run (the references in tests/parity/test_hf_reference.py) is fp64 throughout, not rounded to fp32 here."""
    return t if t.dtype == torch.float64 else t.float()


def _chunk_nll_sum(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    logits = at_least_fp32(F.linear(hidden, weight))
    return F.cross_entropy(logits, labels, reduction="sum")


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
    """Mean next-token NLL of ``hidden @ weight.T`` over the valid ``labels`` (not -100, as ``F.cross_entropy``),
    one chunk of tokens at a time (zero when none is valid).

    hidden [..., dim] (the final norm's output), weight [vocab, dim], labels [...] (same leading
    shape). Equal to ``F.cross_entropy(at_least_fp32(F.linear(hidden, weight)).flatten(0, -2), labels.flatten())``
    up to fp32 summation order.
    """
    h = hidden.flatten(0, -2)
    y = labels.flatten()
    n = y.shape[0]
    total = None
    for start in range(0, n, chunk_tokens):
        stop = min(start + chunk_tokens, n)
        # Non-reentrant checkpoint: saves the chunk's inputs (views of h and y) only, recomputes
        # its logits in backward. It composes with DTensor and torch.compile (unlike reentrant).
        part = checkpoint(_chunk_nll_sum, h[start:stop], weight, y[start:stop], use_reentrant=False)
        total = part if total is None else total + part
    return total / (y != -100).sum().clamp(min=1).to(total.dtype)


__all__ = ["AUTO_CHUNK_TOKENS", "AUTO_MIN_VOCAB", "at_least_fp32", "chunked_cross_entropy", "resolve_chunk_tokens"]
