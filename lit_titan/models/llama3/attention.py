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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("sdpa", "flex")


def attention_mask(backend: str, documents: Tensor | None, seq_len: int, device: torch.device) -> Any:
    """None (plain causal SDPA), a dense bool mask [b, 1, s, s] (SDPA) or a flex ``BlockMask``.

    ``documents`` [b, s]: each token's document index; a query sees keys at or before it in the
    same document.
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.attention={backend!r}; choose one of {BACKENDS}")
    if backend == "sdpa":
        if documents is None:
            return None
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
    from torch.nn.attention.flex_attention import create_block_mask

    if documents is None:
        def mask_mod(b, h, q, kv):
            return q >= kv

        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)

    def doc_mask_mod(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)

    return create_block_mask(doc_mask_mod, B=documents.shape[0], H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                             device=device)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Any = None) -> Tensor:
    """q [b, heads, s, d], k/v [b, kv_heads, s, d] -> [b, heads, s, d]; ``mask`` from ``attention_mask``."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
