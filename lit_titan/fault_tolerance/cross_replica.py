"""The cross-replica process group of one shard position, built anew for each membership.

Only this group spans replica groups; FSDP's shard group stays inside one replica and is never
rebuilt. It is a gloo group made straight from the store (``ProcessGroupGloo(store, rank, size)``):
``new_group`` would need every rank of the default group, dead ones included.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lit_titan.fault_tolerance.membership import PREFIX


class CrossReplicaGroup:
    """The ranks at shard position ``shard`` of every member replica; a sum all-reduce that may fail."""

    def __init__(
        self, store: dist.Store, epoch: int, members: Sequence[int], replica: int, shard: int, timeout_s: float
    ) -> None:
        self.members = list(members)
        self._pg = None
        if len(self.members) > 1:
            prefixed = dist.PrefixStore(f"{PREFIX}e{epoch}/shard{shard}/", store)
            self._pg = dist.ProcessGroupGloo(
                prefixed, self.members.index(replica), len(self.members), timedelta(seconds=timeout_s)
            )

    def all_reduce_sum(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` in place over the members; raises (RuntimeError) when a member is gone."""
        if self._pg is not None:
            self._pg.allreduce([flat]).wait()

    def broadcast(self, tensors: list[torch.Tensor], source: int) -> None:
        """Copy every tensor of member replica ``source`` into the others' (in place)."""
        if self._pg is not None:
            root = self.members.index(source)
            for t in tensors:
                self._pg.broadcast(t, root).wait()
