"""One source's sample order: a pure function of (seed, epoch, chunk sizes, seq_len, streams, window).

Position ``q`` (counted over all epochs) of a source maps to ``(chunk, sample in chunk)``:

1. Epoch ``e = q // P``. The chunks are permuted by ``rng(seed, salt, e)`` and their samples
   laid end to end: the flat sequence ``F`` of ``N`` samples. ``P = (N // streams) * streams``:
   fewer than ``streams`` samples (the tail of ``F``) sit out the epoch; every other sample
   appears exactly once.
2. ``F`` is cut into ``streams`` contiguous canonical streams of ``L = P // streams`` samples.
   Position ``r = q % P`` is sample ``r // streams`` of stream ``r % streams``: consecutive
   positions visit every stream in turn, so a global batch draws from ``streams`` places spread
   over the whole (permuted) dataset, while each stream reads its chunks front to back.
3. Within a stream, samples are shuffled inside consecutive windows of ``window`` samples, so a
   stream needs only the few chunks of its current window at a time.

Why this shape (after MosaicML Streaming's canonical nodes and shuffle blocks): the order never
depends on the number of ranks, micro-batch or loader workers, yet a data-parallel rank that
trains on a fixed set of streams reads only their contiguous run of ``F`` (``batches.py``).
Nothing is materialised per sample: one epoch costs a permutation of the chunks, a window a
permutation of ``window`` numbers, so planning a resume at any position is O(chunks).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# window permutations kept per process (each is `window` int64s; a step touches `streams` of them)
_PERM_CACHE = 4096


class SourceOrder:
    """Positions -> ``(chunk, sample)`` for one source (see the module notes)."""

    def __init__(
        self, chunk_samples: np.ndarray, *, seed: int, streams: int, window: int, shuffle: bool = True, salt: int = 0
    ) -> None:
        self.chunk_samples = np.asarray(chunk_samples, dtype=np.int64)
        self.seed, self.salt, self.shuffle = int(seed), int(salt), bool(shuffle)
        self.total = int(self.chunk_samples.sum())
        self.streams = max(1, min(int(streams), self.total)) if self.total else 1
        self.window = max(1, int(window))
        self.per_epoch = (self.total // self.streams) * self.streams
        self.stream_len = self.per_epoch // self.streams
        self._layouts: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._perms: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_layouts": OrderedDict(), "_perms": OrderedDict()}

    def layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk_perm, starts)``: chunk ids in epoch order, and each one's first flat position (+ end)."""
        got = self._layouts.get(epoch)
        if got is None:
            n = len(self.chunk_samples)
            perm = (
                np.random.default_rng([self.seed, self.salt, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n, dtype=np.int64)
            )
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(self.chunk_samples[perm], out=starts[1:])
            got = (perm, starts)
            self._layouts[epoch] = got
            while len(self._layouts) > 2:
                self._layouts.popitem(last=False)
        return got

    def _window_perm(self, epoch: int, stream: int, window: int) -> np.ndarray:
        key = (epoch, stream, window)
        perm = self._perms.get(key)
        if perm is None:
            size = min(self.window, self.stream_len - window * self.window)
            perm = np.random.default_rng([self.seed, self.salt, epoch, stream, window, 1]).permutation(size)
            self._perms[key] = perm
            while len(self._perms) > _PERM_CACHE:
                self._perms.popitem(last=False)
        return perm

    def flat(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(epoch, flat index into that epoch's F)`` of each position."""
        q = np.asarray(positions, dtype=np.int64)
        if self.per_epoch == 0:
            raise ValueError("this source has fewer samples than streams")
        epoch, r = np.divmod(q, self.per_epoch)
        stream, idx = r % self.streams, r // self.streams
        if not self.shuffle:
            return epoch, stream * self.stream_len + idx
        win, within = np.divmod(idx, self.window)
        shuffled = np.empty_like(idx)
        for i in range(len(q)):
            shuffled[i] = (
                win[i] * self.window + self._window_perm(int(epoch[i]), int(stream[i]), int(win[i]))[within[i]]
            )
        return epoch, stream * self.stream_len + shuffled

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk id, sample index within the chunk)`` of each position."""
        epoch, flat = self.flat(positions)
        chunks = np.empty_like(flat)
        samples = np.empty_like(flat)
        for e in np.unique(epoch):
            sel = epoch == e
            perm, starts = self.layout(int(e))
            slot = np.searchsorted(starts, flat[sel], side="right") - 1
            chunks[sel] = perm[slot]
            samples[sel] = flat[sel] - starts[slot]
        return chunks, samples

    def stream_of(self, positions: np.ndarray) -> np.ndarray:
        return (np.asarray(positions, dtype=np.int64) % self.per_epoch) % self.streams

    def last_use(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk ids, last position)``: after ``last position`` nothing in ``epoch`` reads the chunk.

        Conservative: a chunk counts as in use until the end of the last shuffle window that can
        hold one of its samples (a window is shuffled, so any of its positions may).
        """
        perm, starts = self.layout(epoch)
        lo = np.minimum(starts[:-1], self.per_epoch)
        hi = np.minimum(starts[1:], self.per_epoch) - 1  # last flat index of each chunk in F
        last = np.full(len(perm), -1, dtype=np.int64)
        used = hi >= lo
        # the last stream a chunk reaches, and the index of its last sample in that stream
        stream = hi // max(1, self.stream_len)
        idx = hi - stream * self.stream_len
        if self.shuffle:
            idx = np.minimum((idx // self.window + 1) * self.window, self.stream_len) - 1
        # an earlier stream's part of the chunk ends at that stream's end; later in position order
        # is always the highest stream's window end, except when the chunk's part in a lower stream
        # reaches further into its stream (then that part's end, the lower stream's last index, wins).
        first_stream = lo // max(1, self.stream_len)
        lower_end = np.where(first_stream < stream, self.stream_len - 1, -1)
        pos_hi = epoch * self.per_epoch + idx * self.streams + stream
        pos_lower = epoch * self.per_epoch + lower_end * self.streams + np.maximum(stream - 1, 0)
        last[used] = np.maximum(pos_hi, np.where(lower_end >= 0, pos_lower, -1))[used]
        return perm, last
