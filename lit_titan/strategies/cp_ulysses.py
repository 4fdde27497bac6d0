"""Ulysses context parallelism (``parallel.cp_mode=ulysses``): trade the sequence shard for a head shard.

An all-to-all turns each rank's [b, heads, local_seq, d] Q/K/V (its two balanced chunks of every
head) into [b, heads/cp, seq, d] (every chunk of its share of the heads), plain attention runs on
the whole sequence, and the inverse all-to-all brings the output back to the sequence shard. Per
rank the K/V that attention keeps for backward is heads/cp of the full sequence (all-gather keeps all
heads); the cost is four all-to-alls per layer and heads (and KV heads) divisible by tp x cp.

GQA: heads are split into cp contiguous groups, and so are the KV heads, so query head i keeps
its KV head i // n_rep inside each group, as SDPA's ``enable_gqa`` expects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_titan.models.llama3.attention import attention, window_mask
from lit_titan.strategies.cp_chunks import documents_of, gathered_to_original


def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Piece j of ``x`` along ``scatter_dim`` goes to rank j; the pieces received are joined along ``gather_dim``."""
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The all-to-all above; its backward is the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[b, heads, local_seq, d] -> [b, heads/cp, seq (rank-major chunks), d]."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The inverse of ``seq_to_heads``."""
    return _AllToAll.apply(x, group, 2, 1)


class UlyssesAttention(nn.Module):
    """Causal (windowed, block-causal) attention of the whole sequence over this rank's share of the heads."""

    def __init__(self, group: dist.ProcessGroup, window: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.window = window
        self.cp = dist.get_world_size(group)
        self._order: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def _orders(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(rank-major -> original order, and back), built once per (seq_len, device)."""
        key = (seq_len, device)
        if key not in self._order:
            order = gathered_to_original(seq_len, self.cp)
            self._order[key] = (order.to(device), torch.argsort(order).to(device))
        return self._order[key]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: object = None) -> Tensor:
        docs = documents_of(mask)
        if q.shape[1] % self.cp or k.shape[1] % self.cp:
            raise ValueError(
                f"parallel.cp_mode=ulysses: this rank's {q.shape[1]} heads / {k.shape[1]} KV heads are not "
                f"divisible by parallel.cp={self.cp}; n_heads and n_kv_heads must be divisible by tp x cp"
            )
        seq_len = q.shape[2] * self.cp
        to_original, to_ranks = self._orders(seq_len, q.device)
        q, k, v = (seq_to_heads(t, self.group).index_select(2, to_original) for t in (q, k, v))
        if docs is not None:
            ids = docs.full()
            band = window_mask(seq_len, self.window, q.device)
            attn_mask = ((ids[:, :, None] == ids[:, None, :]) & band)[:, None]
        else:
            attn_mask = None if self.window is None else window_mask(seq_len, self.window, q.device)
        out = attention(q, k, v, attn_mask)
        return heads_to_seq(out.index_select(2, to_ranks), self.group)
