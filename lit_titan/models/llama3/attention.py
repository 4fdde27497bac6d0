"""The one attention entry point: causal or block-causal (documents), through SDPA or FlexAttention.

``model.attention`` picks the kernel:
- ``sdpa``: ``F.scaled_dot_product_attention`` with ``enable_gqa`` (K/V stay at kv_heads width).
  Plain causal uses ``is_causal``; document masking passes a dense boolean [b, 1, s, s] mask, which
  costs s^2 bytes per sequence but runs everywhere (CPU training included).
- ``flex``: ``flex_attention`` with a ``BlockMask``: fully masked blocks are skipped, so packed
  documents cost only their own blocks. torch 2.15 has no flex backward on CPU, so flex trains on
  GPUs only (config validation says so); it runs forward on CPU.

``attention_mask`` builds the mask once per forward (from the documents' ids); every block then
calls ``attention`` with it.

Sliding window (``model.sliding_window=N``): a query at index i sees keys j with i - N < j <= i
(indices in the sequence, not document positions), composed with the document mask. With SDPA and
no documents the mask is ``window_mask``, built once per (length, window, device) and shared.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("sdpa", "flex")


@functools.lru_cache(maxsize=16)
def window_mask(seq_len: int, window: int | None, device: torch.device) -> Tensor:
    """Dense bool [s, s]: causal, and within ``window`` (None: plain causal). Cached: every layer shares it."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return causal if window is None else causal.triu(-(window - 1))


def attention_mask(
    backend: str, documents: Tensor | None, seq_len: int, device: torch.device, window: int | None = None
) -> Any:
    """None (plain causal SDPA), a dense bool mask ([b, 1, s, s] or [s, s]) for SDPA, or a flex ``BlockMask``.

    ``documents`` [b, s]: each token's document index; a query sees keys at or before it in the
    same document. ``window``: and only the ``window`` latest of them (itself included).
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.attention={backend!r}; choose one of {BACKENDS}")
    if documents is not None and not isinstance(documents, Tensor):
        # context parallelism's ShardedDocuments: its attention builds the mask per chunk pair
        return documents
    if backend == "sdpa":
        if documents is None:
            return None if window is None else window_mask(seq_len, window, torch.device(device))
        band = window_mask(seq_len, window, torch.device(device))
        return ((documents[:, :, None] == documents[:, None, :]) & band)[:, None]
    from torch.nn.attention.flex_attention import create_block_mask

    def near(q, kv):
        return (q >= kv) if window is None else (q >= kv) & (q - kv < window)

    if documents is None:

        def mask_mod(b, h, q, kv):
            return near(q, kv)

        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)

    def doc_mask_mod(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & near(q, kv)

    return create_block_mask(doc_mask_mod, B=documents.shape[0], H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """q [b, heads, s, d], k/v [b, kv_heads, s, d] -> [b, heads, s, d]; ``mask`` from ``attention_mask``."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
