"""Where a context-parallel rank's tokens sit in the sequence, and the masks every CP mode builds from that.

Shared by the all-gather core (``context_parallel.py``), Ulysses (``cp_ulysses.py``) and ring
(``cp_ring.py``), so the modes import it and not each other: rank r holds chunks r and 2cp-1-r of 2cp
(causal load balancing), and document ids travel as ``ShardedDocuments``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor


@lru_cache(maxsize=64)
def _balanced_positions_cpu(seq_len: int, cp: int, rank: int) -> Tensor:
    chunk = seq_len // (2 * cp)
    first, second = chunk_blocks(cp, rank)
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def balanced_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Original positions of the tokens cp rank ``rank`` holds, for a full sequence of ``seq_len``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp={2 * cp}; change data.seq_len")
    return _balanced_positions_cpu(seq_len, cp, rank).to(device)


def chunk_blocks(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) cp rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def visible(q_start: int, k_start: int, q_len: int, k_len: int, window: int | None, device: torch.device) -> Tensor:
    """bool [q_len, k_len]: key j (sequence index k_start + j) is causal to query i (q_start + i) and
    within the sliding ``window`` (None: no window)."""
    qi = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    kj = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    seen = kj <= qi
    return seen if window is None else seen & (qi - kj < window)


class ShardedDocuments:
    """This rank's slice of the per-token document ids [b, local_seq], as the attention ``mask``.

    The model's ``attention_mask`` passes any non-tensor mask through, so every layer receives this
    object (also when activation checkpointing recomputes a block, and per pipeline micro-batch:
    the pre-hook wraps each call's ids). ``full()`` all-gathers the ids once per forward.
    """

    def __init__(self, local: Tensor, group: dist.ProcessGroup) -> None:
        self.local = local
        self.group = group
        self._full: Tensor | None = None

    def full(self) -> Tensor:
        """The whole sequence's document ids [b, seq], in the original order (no gradient: ids)."""
        if self._full is None:
            cp = dist.get_world_size(self.group)
            parts = [torch.empty_like(self.local) for _ in range(cp)]
            dist.all_gather(parts, self.local.contiguous(), group=self.group)
            seq_len = self.local.shape[1] * cp
            order = gathered_to_original(seq_len, cp).to(self.local.device)
            self._full = torch.cat(parts, dim=1).index_select(1, order)
        return self._full


def documents_of(mask: object) -> ShardedDocuments | None:
    """The document ids a CP core receives as ``mask`` (None: plain causal); a dense mask is refused."""
    if mask is None or isinstance(mask, ShardedDocuments):
        return mask
    raise TypeError(
        f"context parallelism got a {type(mask).__name__} attention mask; it needs the document ids "
        f"(the model must build its mask with models.llama3.attention.attention_mask, which passes them through)"
    )


@lru_cache(maxsize=64)
def gathered_to_original(seq_len: int, cp: int) -> Tensor:
    """Index that reorders rank-major gathered chunks into original sequence order."""
    gathered = torch.cat([_balanced_positions_cpu(seq_len, cp, r) for r in range(cp)])
    return torch.argsort(gathered)
