"""Replica-group fault tolerance inside ``TitanStrategy`` and the Lightning loop.

Each replica group is its own ``torch.distributed`` world (``replica_world``): FSDP, the checkpoint
writer, the metric reductions and every collective Lightning makes on the default group stay inside
one group, so none of them can wait on a dead group. Only ``ReplicaGroups`` spans the groups, over
the job's store (which must outlive them: ``fault_tolerance.store``, ``launch.py``).

Every rank receives the step's whole global batch (one Lightning batch, no Lightning accumulation)
and ``ReplicaStep.run`` trains the samples ``ReplicaGroups`` assigns it, in micro-batches of
``data.micro_batch_size`` (the accumulation), then makes the cross-replica sum; when a group died
it trains that group's samples on top and sums again. Lightning's own backward is skipped
(``backward_in_training_step``), as under pipeline parallelism.

With pipeline parallelism inside a replica group (``parallel.pp > 1``) each micro-batch is one step of
the pipeline schedule (split into its ``parallel.pp_microbatches``), the stage ranks of a data shard
train the same samples, and each stage rank sums its stage's gradients with the same stage of the
other groups (its position in the group is its cross-replica group). A stage rank's death takes its
whole group out: its peers fail in the schedule's send/receive, or in the group's agreement.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_titan.fault_tolerance.launch import store_address
from lit_titan.fault_tolerance.membership import PREFIX
from lit_titan.fault_tolerance.replicas import ReplicaGroups, ReplicaLost
from lit_titan.fault_tolerance.settings import FaultToleranceConfig

UNSUPPORTED = ("cp", "tp", "ep")  # degrees the step protocol does not span yet (config/rules.py refuses)


def replica_world(
    job_rank: int, group_size: int, replicas: int, backend: str, timeout: timedelta, store: str | None = None
) -> tuple[int, int, bool]:
    """Start this rank's replica group as its own default process group; (replica, rank in the group,
    whether it rejoins).

    A group started again rendezvouses under a new prefix (its start count in the store), so it never
    meets its predecessor's keys; one started again while another group still runs an older start
    rejoins the running job (``ReplicaStep.rejoin``). ``store``: the job's (``launch.store_address``).
    """
    replica, shard = divmod(job_rank, group_size)
    store = dist.TCPStore(*store_address(store), is_master=False, timeout=timeout, wait_for_workers=False)
    generation = (store.add(f"{PREFIX}starts/{replica}", 1) - 1) // group_size
    started = [store.add(f"{PREFIX}starts/{r}", 0) for r in range(replicas)]
    rejoin = generation > 0 and any(count <= generation * group_size for count in started)
    prefixed = dist.PrefixStore(f"{PREFIX}replica{replica}/g{generation}/", store)
    dist.init_process_group(backend, store=prefixed, rank=shard, world_size=group_size, timeout=timeout)
    return replica, shard, rejoin


def set_group_ranks(cluster_environment: Any, job_rank: int, group_size: int) -> None:
    """Lightning's ranks become the replica group's (its world); only the job's rank 0 writes what rank
    zero writes (logs, the run directory's files)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    cluster_environment.set_global_rank(job_rank % group_size)
    cluster_environment.set_world_size(group_size)
    rank_zero_only.rank = fabric_rank_zero_only.rank = job_rank


class ReplicaStep:
    """One rank's training step under replica-group fault tolerance (``ReplicaGroups`` + the module)."""

    def __init__(
        self,
        settings: FaultToleranceConfig,
        replica: int,
        replicas: int,
        shard: int,
        shards: int,
        timeout_s: float,
    ) -> None:
        self.settings, self.timeout_s = settings, timeout_s
        self.replica, self.replicas, self.shard, self.shards = replica, replicas, shard, shards
        self.groups: ReplicaGroups | None = None
        self.micro = 1
        self.data_shard, self.data_shards = shard, shards  # its replica's data-parallel ranks (set in start)
        self.pipeline: Any = None  # the strategy's PipelineRunner under parallel.pp > 1
        self.rejoining = False
        self.first_step = 0  # a rejoining group's: the step it was admitted at

    @classmethod
    def start_world(
        cls,
        settings: FaultToleranceConfig,
        job_rank: int,
        group_size: int,
        replicas: int,
        backend: str,
        timeout: timedelta,
    ) -> ReplicaStep:
        """Start this rank's replica group's world (``replica_world``); the step that spans the groups."""
        replica, shard, rejoin = replica_world(job_rank, group_size, replicas, backend, timeout, settings.store)
        step = cls(settings, replica, replicas, shard, group_size, timeout.total_seconds())
        step.rejoining = rejoin
        return step

    @property
    def job_rank(self) -> int:
        return self.replica * self.shards + self.shard

    def rejoin(self, trainer: Any, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """A group started again: wait to be admitted, take a live peer's weights and optimizer state, and
        start the data at the admitted step (before the loader is built: the strategy's ``setup``)."""
        if trainer.ckpt_path:  # Lightning restores it after setup: it would overwrite the peer's state
            raise RuntimeError(
                f"lit-titan: replica group {self.replica} rejoins a running job with a live peer's state, but "
                f"resume found {trainer.ckpt_path}, which would be loaded over it; start it without resume"
            )
        self.start(trainer, params, optimizer)
        assert self.groups is not None
        self.first_step = self.groups.join()
        data = trainer.datamodule
        data.load_state_dict(data.data_state(self.first_step))

    def on_train_start(self, trainer: Any, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Join the cross-replica group; a rejoined group's loop and LR schedule move to its first step."""
        if self.groups is None:
            self.start(trainer, params, optimizer)
        if not self.first_step:
            return
        loop = trainer.fit_loop.epoch_loop
        steps = loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready = steps.completed = self.first_step
        loop._batches_that_stepped = self.first_step
        for config in trainer.lr_scheduler_configs:  # LambdaLR: the factor is a function of the step
            config.scheduler.last_epoch = self.first_step - 1
            config.scheduler.step()

    @property
    def live_ranks(self) -> int:
        """The job's ranks in live replica groups (those training the global batch now)."""
        members = len(self.groups.members) if self.groups is not None else self.replicas
        return members * self.shards

    def start(self, trainer: Any, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Join the cross-replica group (every live group's ranks meet here, once training starts)."""
        data, strategy = trainer.datamodule, trainer.strategy
        dims = strategy.parallel_dims  # one replica group's (dp_replicate 1): its data shards are dp_shard
        self.data_shard, self.data_shards = dims.dp_rank(self.shard), dims.dp
        self.pipeline = strategy.pipeline
        global_batch = int(data.global_batch_size)
        self.micro = int(data.ft_micro_batch_size(self.replicas * self.data_shards))
        self.groups = ReplicaGroups(
            store_address(self.settings.store),
            self.replica,
            self.replicas,
            self.shard,
            self.shards,
            dist.group.WORLD,
            global_batch,
            run_dir=Path(trainer.default_root_dir),
            timeout_s=self.timeout_s,
            dead_after_s=self.settings.dead_after_s,
            heartbeat_s=self.settings.dead_after_s / 10,
            params=params,
            optimizer=optimizer,
            rejoin=self.rejoining,
            data_shard=self.data_shard,
            data_shards=self.data_shards,
            # a schedule step trains whole micro-batches: hand a dead group's samples over in them
            handover=self.data_shards * self.micro if self.pipeline is not None else None,
        )

    def run(self, module: Any, batch: Any, runner: Any) -> Tensor:
        """Train this rank's samples of the global ``batch``, sum over the replicas; the step's mean loss.

        Each micro-batch is trained by the step runner (``runner.train_part``) with this protocol's factors: its
        valid targets' losses times ``global batch / global valid targets`` (every rank holds the whole batch, so
        the count needs no collective), its auxiliary loss times its sequences; ``ReplicaGroups.reduce`` divides
        by the global batch, which leaves the sum over the global valid targets divided by their count."""
        assert self.groups is not None, "ReplicaStep.start runs at on_train_start"
        whole_inputs, whole_labels, extra = module.inputs_and_labels(batch)
        device = whole_inputs.device
        factor = torch.as_tensor(
            float(self.groups.global_batch), dtype=torch.float64, device=device
        ) / module.count_targets(whole_labels).to(torch.float64)

        dtype = torch.promote_types(next(module.parameters()).dtype, torch.float32)  # the loss sum's, on every rank

        def train(samples: list[int]) -> Tensor:
            """Gradients of this rank's weighted loss sum over ``samples``, micro-batch by micro-batch.

            Under pipeline parallelism the loss sum lives on the last stage (zero on the others): the
            replica's sum over its ranks (``ReplicaGroups.reduce``) is the same either way.
            """
            total = torch.zeros((), device=device, dtype=dtype)
            for i in range(0, len(samples), self.micro):
                rows = samples[i : i + self.micro]
                inputs, labels = whole_inputs[rows], whole_labels[rows]
                kwargs = {k: v[rows] for k, v in extra.items()}
                loss = runner.train_part(
                    module, inputs, labels, kwargs, factor, float(len(rows)), sum_over_stages=False
                )
                total = total + loss
            return total

        loss_sum = train(self.groups.begin_step(module.global_step))
        grads = [p.grad for p in module.model.parameters() if p.grad is not None]
        while True:
            try:
                loss = self.groups.reduce(grads, loss_sum)
                break
            except ReplicaLost:
                loss_sum = loss_sum + train(self.groups.recover())
                grads = [p.grad for p in module.model.parameters() if p.grad is not None]
        module.record_train_loss(loss, whole_inputs)
        return loss

    @property
    def writes_job_files(self) -> bool:
        """Logs, checkpoints and the run directory's files come from replica group 0's first rank."""
        return self.job_rank == 0

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()
