"""How many samples each source gives to each global batch: deterministic, exact, resumable.

Every batch gives source ``i`` either ``floor(w_i * G)`` or one more sample (so each source's
share is within one sample of ``w_i * G`` in every batch), and the ``R = G - sum(floor)`` extra
samples of a batch go to the sources furthest behind their long-run target ``w_i * G * steps``,
ties to the lower index (Megatron's blend, applied to the remainders). The counts of step ``k``
depend only on the cumulative counts before it, which the data state stores, so a resume under
any layout continues the exact sequence.

Why not litdata's ``CombinedStreamingDataset``: it mixes only on average, stops at the first
exhausted source, and cannot resume under another world size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lit_titan.errors import ConfigError


def normalized_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if len(w) == 0:
        raise ConfigError("data.sources is empty; give at least one {path: DIR, weight: W}")
    bad = [i for i, x in enumerate(w) if not np.isfinite(x) or x <= 0]
    if bad:
        raise ConfigError(f"data.sources[{bad[0]}].weight={weights[bad[0]]} must be a positive number")
    return w / w.sum()


class Blend:
    """Per-step sample counts of each source, computed forward from a known cumulative state."""

    def __init__(
        self, weights: Sequence[float], global_batch: int, *, step: int = 0, consumed: Sequence[int] | None = None
    ) -> None:
        self.weights = normalized_weights(weights)
        self.global_batch = int(global_batch)
        target = self.weights * self.global_batch
        self.base = np.floor(target + 1e-9).astype(np.int64)
        self.frac = np.maximum(target - self.base, 0.0)
        self.extra = int(self.global_batch - self.base.sum())
        self._step = int(step)
        self._consumed = (
            np.zeros(len(self.weights), dtype=np.int64)
            if consumed is None
            else np.asarray(consumed, dtype=np.int64).copy()
        )
        if len(self._consumed) != len(self.weights):
            raise ValueError("consumed counts and weights differ in length")
        self._origin = (self._step, self._consumed.copy())

    @property
    def origin_step(self) -> int:
        return self._origin[0]

    def _advance(self) -> np.ndarray:
        counts = self.base.copy()
        if self.extra:
            # remainder deficits: how far each source's extras lag frac * steps (after this one)
            got = self._consumed - self.base * self._step
            deficit = self.frac * (self._step + 1) - got
            order = np.lexsort((np.arange(len(deficit)), -deficit))
            counts[order[: self.extra]] += 1
        self._consumed += counts
        self._step += 1
        return counts

    def consumed_at(self, step: int) -> np.ndarray:
        """Cumulative samples per source before ``step`` (``step`` >= the origin step)."""
        if step < self._step:
            if step < self._origin[0]:
                raise ValueError(f"step {step} is before this blend's origin step {self._origin[0]}")
            self._step, self._consumed = self._origin[0], self._origin[1].copy()
        if not self.extra:  # every batch the same counts: closed form (a resume at any step is O(1))
            self._consumed += self.base * (step - self._step)
            self._step = step
        while self._step < step:
            self._advance()
        return self._consumed.copy()

    def counts(self, step: int) -> np.ndarray:
        """Samples per source in global batch ``step``."""
        before = self.consumed_at(step)
        return self.consumed_at(step + 1) - before
