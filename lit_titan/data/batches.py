"""Global batches from one or more sources, and each data-parallel rank's micro-batches of them.

Global batch ``k`` (``G`` samples) is a pure function of ``k``: the blend (``mixture.py``) says
how many samples each source gives, each source's order (``order.py``) which ones. Its rows are
sorted by their canonical stream's place in the source (``(stream + 0.5) / streams``), and
data-parallel rank ``r`` of ``dp`` trains on rows ``[r * G / dp, (r + 1) * G / dp)``, cut into
micro-batches in row order. So the *set* of samples of every optimizer step is the same for any
layout, micro-batch size, accumulation, pipeline micro-batching or loader workers, and with one
source a rank trains on a fixed contiguous range of streams, i.e. reads only its share of the
chunks (``docs/data.md``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from lit_titan.data.documents import crossing_labels, document_ids, document_positions
from lit_titan.data.mixture import Blend
from lit_titan.data.order import SourceOrder
from lit_titan.data.shards import ShardSplit


@dataclass
class Rows:
    """The rows of one global batch, in rank order: each row's source and position in that source."""

    source: np.ndarray
    position: np.ndarray


class GlobalBatches:
    """Sources + weights + global batch size -> the rows of any global step."""

    def __init__(
        self,
        splits: Sequence[ShardSplit],
        weights: Sequence[float],
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        shuffle: bool = True,
        window: int = 2048,
        step: int = 0,
        consumed: Sequence[int] | None = None,
    ) -> None:
        self.splits = list(splits)
        self.seq_len, self.global_batch = int(seq_len), int(global_batch)
        self.blend = Blend(weights, global_batch, step=step, consumed=consumed)
        self.orders = []
        for i, split in enumerate(self.splits):
            if not shuffle:
                streams = 1
            elif len(self.splits) == 1:
                streams = self.global_batch
            else:
                streams = max(1, int(self.blend.weights[i] * self.global_batch))
            self.orders.append(
                SourceOrder(
                    split.samples_per_chunk(seq_len), seed=seed, streams=streams, window=window, shuffle=shuffle, salt=i
                )
            )
        self._last_use: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._open_epoch: dict[tuple[int, int], int] = {}

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one pass over the (first) source: the length of a Lightning epoch."""
        per_step = max(1, int(self.blend.base[0]) + (1 if self.blend.frac[0] > 0 else 0))
        return self.orders[0].per_epoch // per_step

    def rows(self, step: int) -> Rows:
        before = self.blend.consumed_at(step)
        counts = self.blend.consumed_at(step + 1) - before
        src = np.repeat(np.arange(len(counts)), counts)
        pos = np.concatenate([np.arange(b, b + c, dtype=np.int64) for b, c in zip(before, counts)])
        key = np.empty(len(pos), dtype=np.float64)
        for i, order in enumerate(self.orders):
            sel = src == i
            key[sel] = (order.stream_of(pos[sel]) + 0.5) / order.streams
        rank_order = np.lexsort((pos, src, key))
        return Rows(src[rank_order], pos[rank_order])

    def tokens(self, rows: Rows) -> np.ndarray:
        """``[len(rows), seq_len + 1]`` int32 tokens of ``rows``."""
        out = np.empty((len(rows.position), self.seq_len + 1), dtype=np.int32)
        for i, order in enumerate(self.orders):
            sel = np.flatnonzero(rows.source == i)
            if not len(sel):
                continue
            epochs, _ = order.flat(rows.position[sel]) if order.per_epoch else (None, None)
            chunks, samples = order.locate(rows.position[sel])
            for row, chunk, sample, epoch in zip(sel, chunks, samples, epochs):
                out[row] = self.splits[i].read(int(chunk), int(sample), self.seq_len)
                self._open_epoch[(i, int(chunk))] = int(epoch)
        return out

    def release_before(self, step: int) -> None:
        """Release the chunks this process has open whose last use is before global step ``step``."""
        if step <= self.blend.origin_step or not self._open_epoch:
            return
        consumed = self.blend.consumed_at(step)
        for (i, chunk), epoch in list(self._open_epoch.items()):
            key = (i, epoch)
            if key not in self._last_use:
                perm, last = self.orders[i].last_use(epoch)
                table = np.full(len(perm), -1, dtype=np.int64)
                table[perm] = last
                self._last_use[key] = (perm, table)
                for old in [k for k in self._last_use if k[0] == i and k[1] < epoch - 1]:
                    del self._last_use[old]
            if self._last_use[key][1][chunk] < consumed[i]:
                self.splits[i].release(chunk)
                del self._open_epoch[(i, chunk)]

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.splits)


class RankMicroBatches(Dataset):
    """Map-style: item ``i`` is micro-batch ``i % A`` of global step ``i // A`` for one dp rank.

    ``A = G / (dp * micro)``. Map-style with a sampler (rather than an iterable) so loader
    workers receive indices from the main process and cannot change the order.
    """

    def __init__(
        self,
        batches: GlobalBatches,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        release_margin_steps: int = 2,
        positions_eos_id: int | None = None,
        documents_eos_id: int | None = None,
        ignore_eos_id: int | None = None,
    ) -> None:
        self.batches = batches
        self.positions_eos_id = positions_eos_id
        self.documents_eos_id = documents_eos_id
        self.ignore_eos_id = ignore_eos_id
        self.dp_rank, self.dp_size, self.micro = dp_rank, dp_size, micro_batch_size
        self.per_rank = batches.global_batch // dp_size
        self.accumulation = self.per_rank // micro_batch_size
        self.release_margin_steps = release_margin_steps

    def rows(self, index: int) -> Rows:
        step, j = divmod(int(index), self.accumulation)
        rows = self.batches.rows(step)
        start = self.dp_rank * self.per_rank + j * self.micro
        return Rows(rows.source[start : start + self.micro], rows.position[start : start + self.micro])

    def __getitem__(self, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        step = int(index) // self.accumulation
        tokens = self.batches.tokens(self.rows(index))
        self.batches.release_before(step - self.release_margin_steps)
        if self.positions_eos_id is None and self.documents_eos_id is None:
            return torch.from_numpy(tokens).long()
        out = {"tokens": torch.from_numpy(tokens).long()}
        if self.positions_eos_id is not None:  # data.document_positions
            out["positions"] = torch.from_numpy(document_positions(tokens, self.positions_eos_id))
        if self.documents_eos_id is not None:  # data.document_masking
            out["documents"] = torch.from_numpy(document_ids(tokens, self.documents_eos_id))
        if self.ignore_eos_id is not None:  # the labels that cross into the next document: ignored by the loss
            out["ignore"] = torch.from_numpy(crossing_labels(tokens, self.ignore_eos_id))
        return out


class _RankAware(DistributedSampler):
    """A sampler of a loader that already gives each rank its own rows (``RankMicroBatches``).

    Lightning's ``use_distributed_sampler`` (on by default) wraps every other sampler in a ``DistributedSampler``,
    which would deal whole steps out to the ranks: each rank would train the rows of other steps, silently. It
    leaves a ``DistributedSampler`` alone, so these are one; the base's state (replicas, shuffling) is unused.
    """

    def __init__(self) -> None:  # the base's dataset and replicas do not apply
        self.epoch = 0


class StepSampler(_RankAware):
    """Micro-batch indices of one Lightning epoch: ``[epoch * length, (epoch + 1) * length)``, from ``first`` on.

    Lightning calls :meth:`set_epoch` with the (restored) epoch before each pass, and on a
    mid-epoch resume it counts the batches trained before the checkpoint as part of the epoch:
    it takes ``length - batches_done`` items, which is exactly this range started at the resume
    position ``first``. ``iter`` is side-effect free (torch's multi-worker loader calls it twice).
    """

    def __init__(self, first: int, length: int) -> None:
        super().__init__()
        self.first, self.length = int(first), int(length)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        start = max(self.first, self.epoch * self.length)
        return iter(range(start, (self.epoch + 1) * self.length))

    def __len__(self) -> int:
        return self.length


class FixedSampler(_RankAware):
    """The same indices every pass (validation)."""

    def __init__(self, indices: range) -> None:
        super().__init__()
        self.indices = indices

    def __iter__(self):  # noqa: ANN204
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
