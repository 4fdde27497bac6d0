"""Who trains which samples of a step's global batch, and the weight of each replica's gradient.

Fault-free, data-parallel rank ``d = replica * shards + shard`` trains the ``d``-th contiguous slice
of the global batch. When replicas die, the samples they held are handed, in units of ``shards``
samples (``unit``: under pipeline parallelism ``shards`` micro-batches), to the live replicas,
which keep their own: the step still trains every sample of the global batch once. Each
replica's samples are a list of chunks (its own share, then one chunk per hand-over); a shard rank
trains its even part of every chunk, so the ranks of a replica always hold equally many samples
(FSDP averages over them) and a hand-over during a step only adds work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

Chunk = list[int]


@dataclass
class Assignment:
    """The samples (indices into the step's global batch) of each live replica, as chunks."""

    global_batch: int
    shards: int
    chunks: dict[int, list[Chunk]] = field(default_factory=dict)
    # samples handed over at a time (a multiple of ``shards``; None: ``shards``). Pipeline stages need
    # ``shards x micro-batch``: a rank's gain is then whole schedule steps.
    unit: int | None = None

    @classmethod
    def initial(
        cls, global_batch: int, replicas: int, shards: int, members: Sequence[int], unit: int | None = None
    ) -> Assignment:
        """Every replica's own share; the shares of replicas not in ``members`` handed to the members."""
        if global_batch % (replicas * shards):
            raise ValueError(
                f"global batch {global_batch} does not split over {replicas} x {shards} data-parallel ranks"
            )
        per_replica = global_batch // replicas
        own = {r: [list(range(r * per_replica, (r + 1) * per_replica))] for r in range(replicas)}
        full = cls(global_batch, shards, own, unit)
        dead = [r for r in range(replicas) if r not in members]
        return full.without(dead)[0] if dead else full

    def without(self, dead: Sequence[int]) -> tuple[Assignment, dict[int, Chunk]]:
        """The assignment once ``dead`` replicas are gone, and the chunk each member gains."""
        orphans = [i for r in sorted(dead) for chunk in self.chunks[r] for i in chunk]
        members = sorted(r for r in self.chunks if r not in dead)
        if not members:
            raise ValueError("no live replica left to train the global batch")
        size = self.unit or self.shards
        units = [orphans[i : i + size] for i in range(0, len(orphans), size)]
        gained: dict[int, Chunk] = {}
        start = 0
        for k, r in enumerate(members):  # contiguous, as even as the units allow
            stop = start + len(units) // len(members) + (1 if k < len(units) % len(members) else 0)
            gained[r] = [i for unit in units[start:stop] for i in unit]
            start = stop
        chunks = {r: [*self.chunks[r], gained[r]] for r in members}
        return Assignment(self.global_batch, self.shards, chunks, self.unit), gained

    def samples(self, replica: int) -> int:
        return sum(len(c) for c in self.chunks[replica])

    def rank_samples(self, replica: int, shard: int) -> list[int]:
        """What shard rank ``shard`` of ``replica`` trains: its part of every chunk."""
        return [i for chunk in self.chunks[replica] for i in part(chunk, shard, self.shards)]


def part(chunk: Chunk, shard: int, shards: int) -> Chunk:
    """Shard ``shard``'s even, contiguous part of ``chunk`` (chunks are multiples of ``shards``)."""
    size = len(chunk) // shards
    return chunk[shard * size : (shard + 1) * size]


def replica_weight(replica_samples: int, global_batch: int) -> float:
    """The weight of a replica's mean gradient in the cross-replica sum: its share of the global batch.

    Fault-free every replica holds ``1 / replicas`` of the batch; once survivors train a dead
    replica's samples they hold more, and the weights still sum to one, so the step's gradient is
    the mean over the whole global batch, as on one device.
    """
    return replica_samples / global_batch
