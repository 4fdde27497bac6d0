"""Ring context parallelism (``parallel.cp_mode=ring``): K/V blocks travel around the cp ranks.

Each rank keeps its queries (two balanced chunks) and, at ring step t, holds the K/V block of cp rank
(r - t) mod cp: it attends its query chunks to that block's chunks, sends the block on to rank r+1
while it computes, and merges each step's partial result by its log-sum-exp (the online softmax,
in fp32). A chunk pair that causality or the sliding window leaves empty is skipped; document masks
are the ids' equality on each chunk pair.

Backward is an explicit ``autograd.Function``, not autograd through the steps: autograd would save
every visiting K/V block and each step's scores (memory growing with the full sequence, what this
mode exists to avoid). Forward saves Q, the local K/V, the output and the log-sum-exp; backward
sends the K/V blocks around again, together with their gradient accumulators, which arrive back at
their owner after a full turn (flash attention's backward, per block).

The per-block kernel is plain math (einsum in fp32): it runs on CPU, where SDPA returns no
log-sum-exp through a public API; a fused kernel can replace ``_block_forward``/``_block_backward``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_titan.strategies.cp_chunks import chunk_blocks, documents_of, visible

Skip = bool  # False: the chunk pair has no visible key (its step is skipped)


def chunk_causality(q_block: int, k_block: int, chunk: int, window: int | None, device: torch.device):
    """Which keys of chunk ``k_block`` the queries of chunk ``q_block`` see, by position only:
    False (none), None (all), or a bool [chunk, chunk] mask."""
    if k_block > q_block:
        return False
    if window is not None and (q_block - k_block - 1) * chunk + 1 >= window:
        return False  # the nearest key is already outside every query's window
    if k_block == q_block or (window is not None and (q_block - k_block + 1) * chunk - 1 >= window):
        return visible(q_block * chunk, k_block * chunk, chunk, chunk, window, device)
    return None


def pair_documents(q_block: int, k_block: int, chunk: int, ids: Tensor | None) -> Tensor | None:
    """bool [b, chunk, chunk]: query and key in the same document (None: no document masking)."""
    if ids is None:
        return None
    q_ids = ids[:, q_block * chunk : (q_block + 1) * chunk]
    k_ids = ids[:, k_block * chunk : (k_block + 1) * chunk]
    return q_ids[:, :, None] == k_ids[:, None, :]


def pair_mask(q_block: int, k_block: int, chunk: int, window: int | None, ids: Tensor | None, device: torch.device):
    """False (skip), None (all visible) or a bool mask broadcastable to scores [b, kv_heads, rep, chunk, chunk]."""
    causal = chunk_causality(q_block, k_block, chunk, window, device)
    if causal is False:
        return False
    same = pair_documents(q_block, k_block, chunk, ids)
    if same is None:
        return causal
    return (same if causal is None else same & causal)[:, None, None]


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: combine two partial attentions by their log-sum-exps (rows with none yet: -inf)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out = out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
    return out, new


def _scores(q: Tensor, k: Tensor, mask, scale: float) -> Tensor:
    s = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _block_forward(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> tuple[Tensor, Tensor]:
    """q [b, g, rep, cq, d], k/v [b, g, ck, d] (fp32) -> (softmax(qk) v, log-sum-exp [b, g, rep, cq])."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("bgrqk,bgkd->bgrqd", p, v), lse


def _block_backward(q, k, v, do, lse, delta, mask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one block's share of attention, given the final log-sum-exp."""
    p = torch.exp(_scores(q, k, mask, scale) - lse[..., None])
    dv = torch.einsum("bgrqk,bgrqd->bgkd", p, do)
    ds = p * (torch.einsum("bgrqd,bgkd->bgrqk", do, v) - delta[..., None])
    return torch.einsum("bgrqk,bgkd->bgrqd", ds, k) * scale, torch.einsum("bgrqk,bgrqd->bgkd", ds, q) * scale, dv


def _start_shift(t: Tensor, group: dist.ProcessGroup, tag: int = 0) -> tuple[Tensor, list]:
    """Send ``t`` to the next cp rank and receive the previous rank's (``_finish`` waits); ``tag``
    tells apart two transfers in flight at once (a block and its gradient)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    recv = torch.empty_like(t)
    return recv, [dist.isend(t, nxt, group=group, tag=tag), dist.irecv(recv, prev, group=group, tag=tag)]


def _finish(recv: Tensor, works: list) -> Tensor:
    for w in works:
        w.wait()
    return recv


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 at least (bf16 scores would drift)


def _grouped(x: Tensor, groups: int) -> Tensor:
    """[b, heads, s, d] -> [b, kv_heads, rep, s, d] (query heads grouped by their KV head), fp32 at least."""
    b, h, s, d = x.shape
    return x.to(_compute_dtype(x)).reshape(b, groups, h // groups, s, d)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group, window: int | None, ids: Tensor | None) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, s2, d = q.shape
        g, chunk, scale = k.shape[1], s2 // 2, 1.0 / math.sqrt(d)
        qf = _grouped(q, g)
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=qf.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            pending = _start_shift(kv, group) if step + 1 < cp else None
            src = (rank - step) % cp
            kf, vf = kv[0].to(qf.dtype), kv[1].to(qf.dtype)
            for i, qb in enumerate(chunk_blocks(cp, rank)):
                rows = slice(i * chunk, (i + 1) * chunk)
                for j, kb in enumerate(chunk_blocks(cp, src)):
                    mask = pair_mask(qb, kb, chunk, window, ids, q.device)
                    if mask is False:
                        continue
                    cols = slice(j * chunk, (j + 1) * chunk)
                    part, part_lse = _block_forward(qf[..., rows, :], kf[:, :, cols], vf[:, :, cols], mask, scale)
                    out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], part, part_lse)
            if pending is not None:
                kv = _finish(*pending)
        result = out.reshape(b, h, s2, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.window, ctx.ids = group, window, ids
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, window, ids = ctx.group, ctx.window, ctx.ids
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, s2, d = q.shape
        g, chunk, scale = k.shape[1], s2 // 2, 1.0 / math.sqrt(d)
        qf, do = _grouped(q, g), _grouped(grad, g)
        delta = (do * _grouped(out, g)).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=qf.dtype, device=kv.device)
        for step in range(cp):
            src = (rank - step) % cp
            kf, vf = kv[0].to(qf.dtype), kv[1].to(qf.dtype)
            for i, qb in enumerate(chunk_blocks(cp, rank)):
                rows = slice(i * chunk, (i + 1) * chunk)
                for j, kb in enumerate(chunk_blocks(cp, src)):
                    mask = pair_mask(qb, kb, chunk, window, ids, q.device)
                    if mask is False:
                        continue
                    cols = slice(j * chunk, (j + 1) * chunk)
                    dqi, dkj, dvj = _block_backward(
                        qf[..., rows, :],
                        kf[:, :, cols],
                        vf[:, :, cols],
                        do[..., rows, :],
                        lse[..., rows],
                        delta[..., rows],
                        mask,
                        scale,
                    )
                    dq[..., rows, :] += dqi
                    dkv[0][:, :, cols] += dkj
                    dkv[1][:, :, cols] += dvj
            # the block and its gradient move on; after cp moves the gradient is back at its owner
            pending_kv = _start_shift(kv, group) if step + 1 < cp else None
            dkv = _finish(*_start_shift(dkv, group, tag=1))
            if pending_kv is not None:
                kv = _finish(*pending_kv)
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.reshape(b, h, s2, d).to(q.dtype), dk, dv, None, None, None


class RingAttention(nn.Module):
    """Causal (windowed, block-causal) attention of this rank's query chunks over every rank's K/V, by ring."""

    def __init__(self, group: dist.ProcessGroup, window: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.window = window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: object = None) -> Tensor:
        docs = documents_of(mask)
        return _RingAttention.apply(q, k, v, self.group, self.window, None if docs is None else docs.full())
