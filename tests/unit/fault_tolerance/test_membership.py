"""The pieces of replica-group fault tolerance without training: sample shares and the agreed membership.

The agreement runs on a real TCPStore with each rank in a thread (what it coordinates is processes that share
only the store); a dead rank is one whose heartbeat stops.
"""

from __future__ import annotations

import threading
import time

import pytest

from lit_titan.fault_tolerance.membership import Heartbeat, ReplicaExcluded, agree
from lit_titan.fault_tolerance.shares import Assignment, part, replica_weight


def _rank_samples(a: Assignment, shards: int) -> dict[tuple[int, int], list[int]]:
    return {(r, s): a.rank_samples(r, s) for r in a.chunks for s in range(shards)}


@pytest.mark.parametrize("replicas,shards,dead", [(2, 2, [1]), (3, 2, [1]), (4, 1, [0, 3]), (3, 2, [0, 2])])
def test_every_sample_of_the_global_batch_is_trained_once_whoever_dies(replicas, shards, dead):
    full = Assignment.initial(24, replicas, shards, range(replicas))
    kept, gained = full.without(dead)
    ranks = _rank_samples(kept, shards)
    assert sorted(i for samples in ranks.values() for i in samples) == list(range(24))
    for r in kept.chunks:  # the ranks of a replica hold equally many samples (FSDP averages over them)
        assert len({len(ranks[r, s]) for s in range(shards)}) == 1
        # a hand-over during a step only adds: what each rank had trained is kept, plus its part of the gain
        for s in range(shards):
            assert ranks[r, s] == full.rank_samples(r, s) + part(gained[r], s, shards)
    # the weights of the survivors' mean gradients sum to one: the normaliser is the global batch
    assert sum(replica_weight(kept.samples(r), 24) for r in kept.chunks) == pytest.approx(1.0)
    # the next step, started with the new membership, trains the same samples on the same replicas
    assert _rank_samples(Assignment.initial(24, replicas, shards, sorted(kept.chunks)), shards) == ranks


def test_pipeline_hand_over_is_whole_micro_batches():
    """3 replicas of 1 data shard, 6 samples each, micro-batch 2 (one schedule step): a death hands over whole
    micro-batches (4 and 2 samples), not 3 and 3 (a 1-sample step the schedule's 2 micro-batches cannot split)."""
    kept, gained = Assignment.initial(18, 3, 1, range(3), unit=2).without([1])
    assert {r: len(c) for r, c in gained.items()} == {0: 4, 2: 2}
    assert sorted(i for r in kept.chunks for i in kept.rank_samples(r, 0)) == list(range(18))
    assert {r: len(c) for r, c in Assignment.initial(18, 3, 1, range(3)).without([1])[1].items()} == {0: 3, 2: 3}


def _store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_survivors_agree_on_one_membership_and_a_late_rank_is_left_out():
    """Replicas 0, 1, 2 of one rank each; 2 stops beating. 0 and 1 agree on [0, 1] within the dead time."""
    store = _store()
    beats = {g: Heartbeat("127.0.0.1", store.port, g, 0.05) for g in (0, 1, 2)}
    beats[2].stop()  # rank 2 dies
    got: dict[int, object] = {}

    def join(g: int, delay: float) -> None:
        time.sleep(delay)
        try:
            got[g] = agree(store, 1, [0, 1, 2], 1, g, dead_after_s=0.5, deadline_s=10)
        except ReplicaExcluded as e:
            got[g] = e

    start = time.monotonic()
    threads = [threading.Thread(target=join, args=(g, d)) for g, d in ((0, 0.0), (1, 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: [0, 1], 1: [0, 1]} and time.monotonic() - start < 5
    # Epoch 2: rank 1 joins only after rank 0 has decided without it (its heartbeat stopped meanwhile).
    beats[1].stop()
    assert agree(store, 2, [0, 1], 1, 0, dead_after_s=0.5, deadline_s=10) == [0]
    with pytest.raises(ReplicaExcluded, match="replica 1 is not in epoch 2"):
        agree(store, 2, [0, 1], 1, 1, dead_after_s=0.5, deadline_s=10)
    beats[0].stop()
