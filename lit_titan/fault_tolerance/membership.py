"""Who is alive: a heartbeat per rank and one agreed membership per epoch, both in a TCPStore.

Why a store and not a collective: the collectives that notice a death are the ones that just broke,
and a new process group needs its members first. The store lives outside the replica groups (the
torchrun agent's, or a launcher's), so it outlives any of them.

A rank is alive once it has joined the next epoch (its ``alive`` key), dead once its heartbeat
counter has not moved for ``dead_after_s``; a replica survives only if all its ranks are alive (a
group that lost one rank cannot run its own shard collectives). The first proposal written with
``compare_set`` is the membership every survivor adopts, so all agree even if they saw the deaths
at different times; a rank left out raises ``ReplicaExcluded`` (it goes back to the restart path).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

PREFIX = "lit_titan/ft/"


class ReplicaExcluded(RuntimeError):
    """This rank's replica group is not in the agreed membership: it must leave the job."""


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Heartbeat:
    """A daemon thread that bumps ``hb/<rank>`` every ``interval_s`` over its own store connection."""

    def __init__(self, host: str, port: int, rank: int, interval_s: float) -> None:
        self._store = store_client(host, port, 60.0)
        self._key = f"{PREFIX}hb/{rank}"
        self._interval = interval_s
        self._stop = threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._run, name=f"lit-titan-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store is gone: the job is ending, nothing to tell
                return

    def stop(self) -> None:
        self._stop.set()


def agree(
    store: dist.Store,
    epoch: int,
    members: Sequence[int],
    shards: int,
    me: int,
    dead_after_s: float,
    deadline_s: float,
    poll_s: float = 0.05,
) -> list[int]:
    """The replicas of epoch ``epoch``, agreed by every survivor of ``members`` (global rank ``me``)."""
    store.set(f"{PREFIX}e{epoch}/alive/{me}", "1")
    ranks = {r: [r * shards + s for s in range(shards)] for r in members}
    pending = {g for rs in ranks.values() for g in rs if g != me}
    beats = {g: store.add(f"{PREFIX}hb/{g}", 0) for g in pending}
    moved = dict.fromkeys(pending, time.monotonic())
    alive, dead_replicas = {me}, set()
    end = time.monotonic() + deadline_s
    while pending:
        now = time.monotonic()
        for g in sorted(pending):
            replica = g // shards
            if replica in dead_replicas:
                pending.discard(g)
            elif store.check([f"{PREFIX}e{epoch}/alive/{g}"]):
                alive.add(g)
                pending.discard(g)
            elif (beat := store.add(f"{PREFIX}hb/{g}", 0)) != beats[g]:
                beats[g], moved[g] = beat, now
            elif now - moved[g] >= dead_after_s or now > end:
                dead_replicas.add(replica)
                pending.discard(g)
        if pending:
            time.sleep(poll_s)
    proposal = [r for r in members if r not in dead_replicas and all(g in alive for g in ranks[r])]
    agreed = json.loads(store.compare_set(f"{PREFIX}e{epoch}/members", "", json.dumps(proposal)))
    if me // shards not in agreed:
        raise ReplicaExcluded(f"rank {me}: replica {me // shards} is not in epoch {epoch}'s membership {agreed}")
    return agreed
