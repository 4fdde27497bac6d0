"""``ParallelConfig``: the degrees and parallel settings, ``TitanStrategy``'s argument and the schema's
``parallel`` group (``conf/parallel/default.yaml``) in one declaration; the choice lists they accept.

Free of torch on purpose: the config schema imports it before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_titan.settings import setting

SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
PP_SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
# When FSDP reduce-scatters gradients under gradient accumulation (parallel.grad_reduce_scatter):
#   every_microbatch: after every micro-batch's backward, so each rank keeps only its gradient shard
#     (1/dp_shard of the model) between micro-batches; under HSDP the replicate all-reduce still
#     waits for the last micro-batch. One reduce-scatter per micro-batch.
#   last_microbatch: only after the last one: one reduce-scatter per optimizer step, but between
#     micro-batches every rank holds the *unsharded* gradients (reduce dtype) of its whole model.
GRAD_REDUCE_SCATTER = ("every_microbatch", "last_microbatch")
# How context-parallel attention reaches the keys of other ranks (strategies/context_parallel.py):
#   allgather: all-gather K/V (per-rank K/V memory grows with the full sequence);
#   ulysses: all-to-all sequence <-> heads (n_heads and n_kv_heads divisible by tp*cp);
#   ring: K/V blocks passed around the cp ranks, merged by log-sum-exp.
CP_MODES = ("allgather", "ulysses", "ring")
# Activation checkpointing modes (strategies/transforms.py) and Float8 recipes (callbacks/float8.py, torchao's
# names): declared here, torch-free, so the config schema imports the lists the code checks against.
AC_MODES = ("none", "full", "selective_op", "selective_layer")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class ParallelConfig:
    """Parallel degrees (``dp_shard=-1``: the ranks left over) and how each parallelism is applied."""

    pp: int = setting(1, ge=1)
    dp_replicate: int = setting(1, ge=1)
    dp_shard: int = setting(-1, ge=1, allow=(-1,))
    cp: int = setting(1, ge=1)
    cp_mode: str = setting("allgather", choices=CP_MODES)
    tp: int = setting(1, ge=1)
    # expert parallel: routed experts split over ep ranks borrowed from dp_shard x cp (ParallelDims)
    ep: int = setting(1, ge=1)
    pp_schedule: str = setting("1F1B", choices=PP_SCHEDULES)
    pp_microbatches: int | None = setting(None, ge=1)
    reshard_after_forward: bool = setting(True)
    cpu_offload: bool = setting(False)
    grad_reduce_scatter: str = setting("every_microbatch", choices=GRAD_REDUCE_SCATTER)
    loss_parallel: bool = setting(True)
    pp_stages_per_rank: int | None = setting(None, ge=1)
    pp_stages: list[list[str]] | None = setting(None)

    @property
    def degrees(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
        }
