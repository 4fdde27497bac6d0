"""The step protocol of replica-group fault tolerance (HSDP with ``dp_replicate >= 2``).

A rank trains the samples ``begin_step`` gives it (gradients of the *sum* of its per-sequence
losses, accumulated), then calls ``reduce``. FSDP has already averaged the gradients over the
replica's shard ranks; ``reduce`` weights them by the replica's share of the global batch and sums
them over the replicas in one all-reduce of a flat copy (the gradients are untouched until every
shard rank of the replica knows the sum succeeded). When a replica is gone ``reduce`` raises
``ReplicaLost``: ``recover`` waits for the membership, rebuilds the cross-replica group and returns
the dead replicas' samples this rank trains on top; ``reduce`` is then called again. The step ends
with the same global batch and the same normaliser (the global batch size) as without the fault.

Limits (docs/fault_tolerance.md): a replica dies as a whole (any lost rank takes its group out);
the store must outlive the replica groups; a gloo all-reduce that completes on some members and
fails on others (a death inside the ring's last round, with three or more replicas) is not detected;
the last replica's death, and a rank's own failure, end the job (the restart path).

*Positions* and *data shards*: a replica's ranks (``shards`` of them, one per position) each sum with
the rank at the same position of every other replica; its data shards (``data_shards``, FSDP's
ranks) split the replica's samples. They differ under pipeline parallelism inside a replica: the
stage ranks of one data shard train the same samples, and each sums its own stage's gradients.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lit_titan.fault_tolerance.cross_replica import CrossReplicaGroup
from lit_titan.fault_tolerance.events import MembershipChange, record
from lit_titan.fault_tolerance.membership import PREFIX, Heartbeat, agree, store_client
from lit_titan.fault_tolerance.shares import Assignment, part, replica_weight
from lit_titan.fault_tolerance.transfer import materialise_optimizer_state, state_tensors

# A waiting group is admitted this many steps after the leader sees it: every member reads the
# decision at its next step's start (it cannot start that step before the leader's FSDP collectives
# of this one), so all switch at the same step boundary.
ADMIT_AFTER_STEPS = 2


class ReplicaLost(RuntimeError):
    """The cross-replica sum failed on this replica: call ``recover`` and train what it returns."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP's sharded gradient), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaGroups:
    """One rank's view of the replica groups: membership, the cross-replica group, the sample shares."""

    def __init__(
        self,
        store_addr: tuple[str, int],
        replica: int,
        replicas: int,
        shard: int,
        shards: int,
        shard_group: dist.ProcessGroup,
        global_batch: int,
        run_dir: str | Path | None = None,
        timeout_s: float = 60.0,
        dead_after_s: float = 5.0,
        heartbeat_s: float = 0.25,
        params: Sequence[torch.Tensor] = (),
        optimizer: torch.optim.Optimizer | None = None,
        rejoin: bool = False,
        data_shard: int | None = None,
        data_shards: int | None = None,
        handover: int | None = None,
    ) -> None:
        """``shard``/``shards``: this rank's position in its replica and the replica's rank count;
        ``data_shard``/``data_shards``: its data-parallel index in the replica and their count (FSDP's
        ranks; default: every rank is one); ``handover``: the samples a dead replica's share is handed
        over in (default ``data_shards``); ``params``/``optimizer``: what a rejoining group receives
        (needed to admit one); ``rejoin``: this rank belongs to a group restarted after it left; call
        ``join`` before training."""
        self.replica, self.replicas, self.shard, self.shards = replica, replicas, shard, shards
        self.data_shard = shard if data_shard is None else data_shard
        self.data_shards = shards if data_shards is None else data_shards
        self.handover = handover
        self.rank = replica * shards + shard
        self.shard_group, self.global_batch, self.run_dir = shard_group, global_batch, run_dir
        self.timeout_s, self.dead_after_s = timeout_s, dead_after_s
        self.store = store_client(*store_addr, timeout_s)
        # A restarted rank beats only once admitted: survivors still agreeing on its death watch the same key.
        self._store_addr, self._heartbeat_s = store_addr, heartbeat_s
        self._heartbeat = None if rejoin else Heartbeat(*store_addr, self.rank, heartbeat_s)
        self.params, self.optimizer = list(params), optimizer
        self.epoch, self.members = 0, list(range(replicas))
        self.group = None if rejoin else CrossReplicaGroup(self.store, 0, self.members, replica, shard, timeout_s)
        self.assignment = Assignment.initial(global_batch, replicas, self.data_shards, self.members, handover)
        self.step, self._detect_s = -1, 0.0

    def join(self) -> int:
        """Wait to be admitted, take a live peer's weights and optimizer state; the step to train next."""
        generation = self.store.add(f"{PREFIX}join/{self.replica}", 1)
        key = f"{PREFIX}admitted/{self.replica}/{(generation - 1) // self.shards}"
        self.store.wait([key], timedelta(seconds=self.timeout_s * 10))
        decision = json.loads(self.store.get(key))
        self._heartbeat = Heartbeat(*self._store_addr, self.rank, self._heartbeat_s)
        self.epoch, self.members = decision["epoch"], decision["members"]
        self.group = CrossReplicaGroup(self.store, self.epoch, self.members, self.replica, self.shard, self.timeout_s)
        materialise_optimizer_state(self.params, self.optimizer)
        self.group.broadcast(state_tensors(self.params, self.optimizer), decision["source"])
        return decision["step"]

    def _leader(self) -> bool:
        return self.rank == self.members[0] * self.shards

    def _admit(self, step: int) -> None:
        """Admit replica groups waiting to rejoin: decided by the leader, applied by all at one step."""
        key = f"{PREFIX}e{self.epoch + 1}/admit"
        if self._leader() and self.optimizer is not None and not self.store.check([key]):
            waiting = [
                r
                for r in range(self.replicas)
                if r not in self.members
                and self.store.add(f"{PREFIX}join/{r}", 0)
                >= self.shards * (self.store.add(f"{PREFIX}admissions/{r}", 0) + 1)
            ]
            if waiting:
                decision = {
                    "step": step + ADMIT_AFTER_STEPS,
                    "epoch": self.epoch + 1,
                    "members": sorted(self.members + waiting),
                    "joined": waiting,
                    "source": self.members[0],
                }
                decision = json.loads(self.store.compare_set(key, "", json.dumps(decision)))
                for r in decision["joined"]:
                    n = self.store.add(f"{PREFIX}admissions/{r}", 1) - 1
                    self.store.set(f"{PREFIX}admitted/{r}/{n}", json.dumps(decision))
        if not self.store.check([key]):
            return
        decision = json.loads(self.store.get(key))
        if decision["step"] != step:
            return
        start = time.monotonic()
        self.epoch, self.members = decision["epoch"], decision["members"]
        self.group = CrossReplicaGroup(self.store, self.epoch, self.members, self.replica, self.shard, self.timeout_s)
        regrouped = time.monotonic()
        self.group.broadcast(state_tensors(self.params, self.optimizer), decision["source"])
        if self._leader():
            joined = decision["joined"]
            change = MembershipChange(
                step=step,
                epoch=self.epoch,
                event="joined",
                replicas=" ".join(map(str, joined)),
                ranks=" ".join(str(r * self.shards + s) for r in joined for s in range(self.shards)),
                members=" ".join(map(str, self.members)),
                detect_s=0.0,
                agree_s=0.0,
                rebuild_s=regrouped - start,
                transfer_s=time.monotonic() - regrouped,
            )
            record(change, self.run_dir)

    def begin_step(self, step: int) -> list[int]:
        """This rank's samples of the step's global batch (indices), for the current membership.

        Replica groups waiting to rejoin are admitted here, at a step boundary agreed in the store.
        """
        self.step = step
        self._admit(step)
        self.assignment = Assignment.initial(
            self.global_batch, self.replicas, self.data_shards, self.members, self.handover
        )
        return self.assignment.rank_samples(self.replica, self.data_shard)

    def _weight(self) -> float:
        return replica_weight(self.assignment.samples(self.replica), self.global_batch)

    @torch.no_grad()
    def reduce(self, grads: Sequence[torch.Tensor], loss_sum: torch.Tensor) -> torch.Tensor:
        """Make ``grads`` the step's global mean gradient; returns the step's mean loss.

        ``grads``: this rank's gradients (FSDP-sharded or not) of the sum of its per-sequence
        losses, averaged by FSDP over the replica's data shards; ``loss_sum``: that sum of losses
        (zero on a rank whose pipeline stage does not compute the loss).
        """
        samples = self.assignment.samples(self.replica)
        locals_ = [_local(g) for g in grads]
        # fp32 sums (bf16 gradients are reduced in fp32), float64 in a float64 run (the loss sum is in the
        # parameters' dtype on every rank, so every rank picks the same one)
        dtype = torch.promote_types(loss_sum.dtype, torch.float32)
        loss = loss_sum.detach().to(dtype).reshape(1).clone()
        dist.all_reduce(loss, group=self.shard_group)  # the replica's loss sum (the shard group is intact)
        scale = self._weight() / samples  # replica mean (x data shards: FSDP averaged), weighted by its share
        flat = torch.cat([g.reshape(-1).to(dtype) * self.data_shards for g in locals_] + [loss]) * scale
        ok = torch.ones(1)
        start = time.monotonic()
        try:
            self.group.all_reduce_sum(flat)
        except RuntimeError:
            ok.zero_()
        self._detect_s = time.monotonic() - start
        # Every shard rank of this replica learns whether all shard positions got their sum.
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.shard_group)
        if ok.item() == 0:
            raise ReplicaLost(f"step {self.step}: a replica group left (epoch {self.epoch}, members {self.members})")
        offset = 0
        for g in locals_:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[-1]

    def recover(self) -> list[int]:
        """Agree on the survivors, rebuild the cross-replica group; the extra samples this rank trains."""
        extra: list[int] = []
        while True:
            start = time.monotonic()
            epoch = self.epoch + 1
            members = agree(
                self.store, epoch, self.members, self.shards, self.rank, self.dead_after_s, deadline_s=self.timeout_s
            )
            agreed = time.monotonic()
            left = [r for r in self.members if r not in members]
            self.assignment, gained = self.assignment.without(left)
            extra += part(gained[self.replica], self.data_shard, self.data_shards)
            self.epoch, self.members = epoch, members
            try:
                self.group = CrossReplicaGroup(self.store, epoch, members, self.replica, self.shard, self.timeout_s)
            except RuntimeError:  # another member died while regrouping: one more epoch
                continue
            if self._leader():
                ranks = [r * self.shards + s for r in left for s in range(self.shards)]
                change = MembershipChange(
                    step=self.step,
                    epoch=epoch,
                    event="left",
                    replicas=" ".join(map(str, left)),
                    ranks=" ".join(map(str, ranks)),
                    members=" ".join(map(str, members)),
                    detect_s=self._detect_s,
                    agree_s=agreed - start,
                    rebuild_s=time.monotonic() - agreed,
                )
                record(change, self.run_dir)
            return extra

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
