"""Deliberate bugs, one at a time, applied by monkeypatching inside the worker processes.

Each mutant is a small realistic bug in the narrowest lit_titan function (or the narrowest library
call lit_titan makes) that its code would live in. Production code has no switch for any of them:
``applied(name)`` patches the live objects for one case and restores them afterwards (the reused
worlds of tests/support/world.py run many cases in one process). tests/parity/test_mutants.py runs each one against
the parity case that targets it and asserts that the parity check fails by a wide margin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what is wrong, in words
    where: str  # the lit_titan code the bug would live in
    apply: Callable[[_Patcher], None]


class _Patcher:
    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, attr: str, value: Any) -> None:
        self._undo.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
        setattr(owner, attr, value)

    def undo(self) -> None:
        for owner, attr, value in reversed(self._undo):
            setattr(owner, attr, value)
        self._undo.clear()


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, bug: str, where: str):
    def register(fn: Callable[[_Patcher], None]) -> Callable[[_Patcher], None]:
        MUTANTS[name] = Mutant(name, bug, where, fn)
        return fn

    return register


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    if not name:
        yield
        return
    patcher = _Patcher()
    MUTANTS[name].apply(patcher)
    try:
        yield
    finally:
        patcher.undo()


# ---- the mutants ---------------------------------------------------------------------------------
@mutant(
    "cp_rope_rank0_positions",
    "every context-parallel rank uses rank 0's RoPE positions",
    "strategies/context_parallel.py: ContextParallel._inject_positions",
)
def _cp_rope_rank0(p: _Patcher) -> None:
    from lit_titan.strategies import context_parallel as cp

    def inject(self, module, args, kwargs):
        local = args[0].shape[1]
        device = args[0].device if not hasattr(args[0], "to_local") else args[0].to_local().device
        return args[:1], {**kwargs, "positions": cp.balanced_positions(local * self.cp, self.cp, 0, device)}

    p.set(cp.ContextParallel, "_inject_positions", inject)


@mutant(
    "cp_allgather_backward_local",
    "the K/V all-gather's backward keeps the local gradient (no reduction)",
    "strategies/context_parallel.py: _AllGatherSeq.backward",
)
def _cp_allgather_bwd(p: _Patcher) -> None:
    from lit_titan.strategies import context_parallel as cp

    def backward(ctx, grad):
        import torch.distributed as dist

        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=ctx.dim)[rank].contiguous(), None, None

    p.set(cp._AllGatherSeq, "backward", staticmethod(backward))


@mutant(
    "pp_loss_scale_ignores_accumulation",
    "the pipeline loss scale forgets gradient accumulation (each micro-batch normalised as if it were the step)",
    "strategies/step.py: StepRunner.train_part (the normaliser's factor under pp)",
)
def _pp_scale(p: _Patcher) -> None:
    from lit_titan.strategies.step import StepRunner

    original = StepRunner.train_part

    def train_part(self, module, x, y, kw, factor, aux_weight, *args, **kwargs):
        if self.strategy.pipeline is not None:  # aux_weight is 1 / the step's micro-batches
            factor = factor / aux_weight
        return original(self, module, x, y, kw, factor, aux_weight, *args, **kwargs)

    p.set(StepRunner, "train_part", train_part)


@mutant(
    "normaliser_per_rank_mean",
    "each rank normalises its loss by its own valid targets, and the ranks' means are averaged",
    "strategies/step.py: StepRunner.global_count / average_divisor",
)
def _per_rank_mean(p: _Patcher) -> None:
    from lit_titan.strategies.step import StepRunner

    _count_one_rank(p)
    p.set(StepRunner, "average_divisor", lambda self: 1)


@mutant(
    "normaliser_count_one_rank",
    "the step's valid targets are counted on this rank only (not summed over the ranks sharing the batch)",
    "strategies/step.py: StepRunner.global_count",
)
def _count_one_rank(p: _Patcher) -> None:
    from lit_titan.strategies.step import StepRunner

    def global_count(self, module, parts, async_op=False):
        return torch.stack([module.count_targets(y) for _, y, _ in parts]).sum(), None

    p.set(StepRunner, "global_count", global_count)


@mutant(
    "normaliser_per_micro_batch_mean",
    "each micro-batch's loss is its own valid-target mean, and the micro-batches' means are averaged",
    "strategies/step.py: StepRunner.train_part (the normaliser's factor)",
)
def _per_micro_batch_mean(p: _Patcher) -> None:
    from lit_titan.strategies.step import StepRunner

    original = StepRunner.train_part

    def train_part(self, module, x, y, kw, factor, aux_weight, *args, **kwargs):
        own = aux_weight * self.average_divisor() / module.count_targets(y).to(torch.float64)
        return original(self, module, x, y, kw, own, aux_weight, *args, **kwargs)

    p.set(StepRunner, "train_part", train_part)


@mutant(
    "eval_moves_expert_bias",
    "validation forwards count their tokens into the expert bias's next update",
    "models/moe.py: MoE._record (the training-only bias counts)",
)
def _eval_moves_bias(p: _Patcher) -> None:
    from lit_titan.models import moe

    original = moe.MoE._record

    def record(self, scores, indices, counts, bs, seqlen):
        original(self, scores, indices, counts, bs, seqlen)
        if not self.training and self.counting is None and self.args.bias_update_rate > 0:
            self.tokens_per_expert += counts.detach().to(torch.float32)

    p.set(moe.MoE, "_record", record)


@mutant(
    "pp_drops_last_microbatch",
    "the pipeline schedule drops the last micro-batch's gradient",
    "strategies/pipeline.py: PipelineRunner._scaled_loss",
)
def _pp_last_mb(p: _Patcher) -> None:
    from lit_titan.strategies.pipeline import PipelineRunner

    original_step, original_loss = PipelineRunner.train_step, PipelineRunner._scaled_loss

    def train_step(self, *args, **kwargs):
        self._mutant_mb = 0
        return original_step(self, *args, **kwargs)

    def scaled_loss(self, output, target):
        loss = original_loss(self, output, target)
        self._mutant_mb = getattr(self, "_mutant_mb", 0) + 1
        return loss * 0 if self._mutant_mb == self.microbatches else loss

    p.set(PipelineRunner, "train_step", train_step)
    p.set(PipelineRunner, "_scaled_loss", scaled_loss)


@mutant(
    "grad_norm_local_shard",
    "the global grad norm (logged, and used for clipping) from each rank's shard only",
    "strategies/grad_norm.py: total_grad_norm",
)
def _norm_local(p: _Patcher) -> None:
    import lit_titan.module as module
    from lit_titan.strategies import grad_norm

    original = grad_norm.total_grad_norm

    class _Local:
        def __init__(self, p):
            g = p.grad
            self.grad = g.to_local() if hasattr(g, "to_local") else g

    def total_grad_norm(params, pp_group=None, norm_type=2.0):
        return original([_Local(q) for q in params if q.grad is not None], pp_group, norm_type)

    p.set(module, "total_grad_norm", total_grad_norm)


@mutant(
    "grad_norm_misses_pp_stages",
    "the global grad norm leaves out the other pipeline stages",
    "strategies/grad_norm.py: total_grad_norm",
)
def _norm_pp(p: _Patcher) -> None:
    import lit_titan.module as module
    from lit_titan.strategies import grad_norm

    original = grad_norm.total_grad_norm
    p.set(module, "total_grad_norm", lambda params, pp_group=None, norm_type=2.0: original(params, None, norm_type))


@mutant(
    "grad_norm_counts_experts_twice",
    "the global grad norm counts the stacked expert weights twice (once more beside their own mesh's group)",
    "strategies/grad_norm.py: total_grad_norm",
)
def _norm_experts_twice(p: _Patcher) -> None:
    import lit_titan.module as module
    from lit_titan.strategies import grad_norm

    original = grad_norm.total_grad_norm

    def total_grad_norm(params, pp_group=None, norm_type=2.0):
        params = list(params)
        return original(params + [q for q in params if q.ndim == 3], pp_group, norm_type)

    p.set(module, "total_grad_norm", total_grad_norm)


@mutant(
    "silent_corruption_on_one_rank",
    "rank 1's copy of every parameter moves one ulp after each optimizer step (a node corrupting memory)",
    "any replicated state (LightningModule.optimizer_step)",
)
def _corrupt_one_rank(p: _Patcher) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    original = pl.LightningModule.optimizer_step

    def optimizer_step(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if dist.get_rank() == 1:
            with torch.no_grad():
                for q in self.parameters():
                    local = q.to_local() if hasattr(q, "to_local") else q
                    local.copy_(torch.nextafter(local, torch.full_like(local, float("inf"))))

    p.set(pl.LightningModule, "optimizer_step", optimizer_step)


def _patch_fsdp_divide(p: _Patcher, factor: Callable[[Any], float]) -> None:
    from lit_titan.strategies import strategy

    original = strategy.apply_fsdp

    def apply_fsdp(units, root, mesh, precision, cfg):
        original(units, root, mesh, precision, cfg)
        from torch.distributed.fsdp import FSDPModule

        for m in root.modules():
            if isinstance(m, FSDPModule):
                # SUM collectives then one division (gloo has no PREMUL_SUM for a custom factor)
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(factor(mesh))

    p.set(strategy, "apply_fsdp", apply_fsdp)


@mutant(
    "fsdp_sums_gradients",
    "FSDP sums the data-parallel gradients instead of averaging them",
    "strategies/fsdp.py: apply_fsdp",
)
def _fsdp_sum(p: _Patcher) -> None:
    _patch_fsdp_divide(p, lambda mesh: 1.0)


@mutant(
    "hsdp_replicate_sums",
    "HSDP's replicate all-reduce sums instead of averaging (divides by the shard size only)",
    "strategies/fsdp.py: apply_fsdp",
)
def _hsdp_sum(p: _Patcher) -> None:
    _patch_fsdp_divide(p, lambda mesh: float(mesh.size(mesh.ndim - 1)))


@mutant(
    "tp_dropped_reduction",
    "the feed-forward output projection's TP reduction is dropped (each rank keeps its partial sum)",
    "strategies/tensor_parallel.py: tp_plans",
)
def _tp_drop(p: _Patcher) -> None:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from lit_titan.strategies import tensor_parallel as tp

    class NoReduceRowwise(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            local = outputs.to_local()  # a partial sum: the reduce-scatter that should follow is missing
            piece = local.chunk(device_mesh.size(), dim=1)[device_mesh.get_local_rank()]
            out = DTensor.from_local(piece, device_mesh, [Shard(1)], run_check=False)
            return out.to_local() if use_local_output else out

    original = tp.tp_plans

    def tp_plans(*args, **kwargs):
        plans = original(*args, **kwargs)
        for _, styles in plans:
            if isinstance(styles, dict) and isinstance(styles.get("feed_forward.w2"), RowwiseParallel):
                old = styles["feed_forward.w2"]
                styles["feed_forward.w2"] = NoReduceRowwise(
                    output_layouts=old.output_layouts[0], use_local_output=old.use_local_output
                )
        return plans

    p.set(tp, "tp_plans", tp_plans)


@mutant(
    "data_order_depends_on_dp",
    "the global sample order depends on the data-parallel degree",
    "data/datamodule.py: PretrainDataModule._global_batches (order seed)",
)
def _data_order(p: _Patcher) -> None:
    from lit_titan.data.datamodule import PretrainDataModule

    original = PretrainDataModule._global_batches

    def global_batches(self, *args, **kwargs):
        saved = self.seed
        dp = getattr(getattr(getattr(self, "trainer", None), "strategy", None), "data_parallel_size", 1)
        self.seed = saved + dp - 1
        try:
            return original(self, *args, **kwargs)
        finally:
            self.seed = saved

    p.set(PretrainDataModule, "_global_batches", global_batches)


@mutant(
    "resume_skips_optimizer_state",
    "a resume does not restore the optimizer state",
    "checkpoint/writer.py: load_sharded",
)
def _resume_optim(p: _Patcher) -> None:
    from lit_titan.strategies import strategy

    original = strategy.load_sharded
    p.set(strategy, "load_sharded", lambda model, optimizers, ckpt, **kw: original(model, [], ckpt, **kw))


@mutant(
    "resume_skips_data_position",
    "a resume restarts the data from the first batch",
    "data/datamodule.py: PretrainDataModule.load_state_dict",
)
def _resume_data(p: _Patcher) -> None:
    from lit_titan.data.datamodule import PretrainDataModule

    p.set(PretrainDataModule, "load_state_dict", lambda self, state_dict: None)


@mutant(
    "resume_skips_lr_scheduler",
    "a resume restarts the learning-rate schedule from step 0",
    "checkpoint/writer.py: load_sharded (the meta Lightning restores schedulers from)",
)
def _resume_lr(p: _Patcher) -> None:
    from lit_titan.strategies import strategy

    original = strategy.load_sharded

    def load_sharded(model, optimizers, ckpt, **kw):
        meta = original(model, optimizers, ckpt, **kw)
        for state in meta.get("lr_schedulers", []):
            state["last_epoch"], state["_step_count"] = 0, 1
            state["_last_lr"] = list(state.get("base_lrs", state.get("_last_lr", [])))
        return meta

    p.set(strategy, "load_sharded", load_sharded)


@mutant(
    "loss_parallel_local_logsumexp",
    "loss parallel normalises the log-softmax over each TP rank's vocab shard only (a local logsumexp)",
    "strategies/strategy.py: TitanStrategy._loss_context (loss_parallel)",
)
def _loss_parallel_local(p: _Patcher) -> None:
    # The bug a hand-written vocab-parallel cross-entropy makes when it forgets the all-reduces: torch's
    # loss_parallel() computes log_softmax on the local logits (Shard(-1)) with a MAX and a SUM
    # all-reduce over the TP mesh dim; here each rank keeps its own shard's logsumexp.
    import torch
    from torch.distributed.tensor.parallel import loss

    def local_log_softmax(x, dim, half_to_float, mesh, mesh_dim):
        return torch._log_softmax(x, dim, half_to_float)

    p.set(loss, "_log_softmax", local_log_softmax)


@mutant(
    "rope_positions_off_after_document",
    "after a document boundary the RoPE positions restart one token "
    "late (the first token of each document continues the previous document's positions)",
    "data/documents.py: document_positions",
)
def _positions_off_by_one(p: _Patcher) -> None:
    import numpy as np

    from lit_titan.data import batches, documents

    def document_positions(tokens, eos_id):
        inputs = np.asarray(tokens)[:, :-1]
        m, s = inputs.shape
        idx = np.broadcast_to(np.arange(s, dtype=np.int64), (m, s))
        starts = np.zeros((m, s), dtype=np.int64)
        starts[:, 2:] = np.where(inputs[:, :-2] == eos_id, idx[:, 2:], 0)  # one token late
        return idx - np.maximum.accumulate(starts, axis=1)

    p.set(documents, "document_positions", document_positions)
    p.set(batches, "document_positions", document_positions)


@mutant(
    "ft_survivors_keep_old_normaliser",
    "after a replica group dies, the survivors still weight their gradients by the old replica count (1 / replicas)",
    "fault_tolerance/replicas.py: ReplicaGroups._weight",
)
def _ft_old_normaliser(p: _Patcher) -> None:
    from lit_titan.fault_tolerance.replicas import ReplicaGroups

    p.set(ReplicaGroups, "_weight", lambda self: 1.0 / self.replicas)


@mutant(
    "ft_dead_samples_skipped",
    "after a replica group dies, its samples are not handed to the survivors (torchft's behaviour)",
    "fault_tolerance/shares.py: Assignment.without",
)
def _ft_dead_samples_skipped(p: _Patcher) -> None:
    from lit_titan.fault_tolerance import shares

    original = shares.Assignment.without

    def without(self, dead):
        kept, gained = original(self, dead)
        chunks = {r: c[:-1] + [[]] for r, c in kept.chunks.items()}
        return shares.Assignment(self.global_batch, self.shards, chunks), {r: [] for r in gained}

    p.set(shares.Assignment, "without", without)


@mutant(
    "ft_rejoin_stale_weights",
    "a replica group that rejoins keeps the weights and optimizer state it restarted with (no transfer from a peer)",
    "fault_tolerance/cross_replica.py: CrossReplicaGroup.broadcast",
)
def _ft_rejoin_stale(p: _Patcher) -> None:
    from lit_titan.fault_tolerance.cross_replica import CrossReplicaGroup

    p.set(CrossReplicaGroup, "broadcast", lambda self, tensors, source: None)


@mutant(
    "ft_pp_sum_skips_a_stage",
    "with pipeline stages inside a replica group, the cross-replica sum leaves out the second stage's parameters "
    "(their gradients stay the replica's own)",
    "fault_tolerance/lightning_step.py: ReplicaStep.run (the gradients handed to ReplicaGroups.reduce)",
)
def _ft_pp_sum_skips_a_stage(p: _Patcher) -> None:
    from lit_titan.fault_tolerance.replicas import ReplicaGroups

    original = ReplicaGroups.reduce

    def reduce(self, grads, loss_sum):
        return original(self, grads if self.shard == 0 else [], loss_sum)  # position 1: pp rank 1 (pp2 x dp_shard 1)

    p.set(ReplicaGroups, "reduce", reduce)


@mutant(
    "muon_orthogonalises_each_shard",
    "Muon orthogonalises each rank's FSDP/TP shard of a matrix on its own, not the whole matrix",
    "optim/muon.py: orthogonalised_update",
)
def _muon_shardwise(p: _Patcher) -> None:
    from lit_titan.optim import muon

    def shardwise(momentum, like, steps):
        return muon.newton_schulz(momentum, steps) * muon.update_scale(like.shape)

    p.set(muon, "orthogonalised_update", shardwise)


from mutants import context_parallel as _context_parallel  # noqa: E402,F401  (registers the CP-mode mutants)


# ---- MoE (the Qwen3-MoE family; tests/parity/test_moe_parity.py's regime) ---------------------------------
@mutant(
    "moe_router_grad_not_reduced_over_tp",
    "the MoE output goes back to the sequence slice without gathering its gradient: each tp rank's router "
    "and expert gradients hold only its own tokens' share (partial) and are never reduced over tp",
    "models/qwen3_moe/parallelize.py: shard_output",
)
def _moe_router_partial_tp(p: _Patcher) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from lit_titan.models.qwen3_moe import parallelize

    def shard_output(module, output, mesh):
        local = output.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]
        return DTensor.from_local(local, mesh, [Shard(1)], run_check=False)

    p.set(parallelize, "shard_output", shard_output)


@mutant(
    "moe_capacity_drops_tokens",
    "a capacity limit (factor 1.0, per rank) drops the assignments past an expert's capacity",
    "models/moe.py: Router.forward",
)
def _moe_capacity(p: _Patcher) -> None:
    import math

    import torch

    from lit_titan.models import moe

    original = moe.Router.forward

    def forward(self, x, expert_bias=None):
        scores, weights, indices = original(self, x, expert_bias)
        capacity = math.ceil(indices.numel() / self.args.num_experts)
        flat = indices.reshape(-1)
        onehot = torch.nn.functional.one_hot(flat, self.args.num_experts)
        position = (onehot.cumsum(0) * onehot).sum(-1)  # 1-based place of each assignment in its expert's queue
        keep = (position <= capacity).reshape(indices.shape).to(weights.dtype)
        return scores, weights * keep, indices

    p.set(moe.Router, "forward", forward)


@mutant(
    "moe_topk_ties_rank_dependent",
    "top-k breaks ties between equal scores in an order that depends on the rank (as topk may per device)",
    "models/moe.py: stable_topk",
)
def _moe_ties(p: _Patcher) -> None:
    import torch
    import torch.distributed as dist

    from lit_titan.models import moe

    original = moe.stable_topk

    def stable_topk(scores, k):
        if not dist.is_initialized() or dist.get_rank() == 0:
            return original(scores, k)
        flipped = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
        return scores.shape[-1] - 1 - flipped  # ties go to the highest index

    p.set(moe, "stable_topk", stable_topk)


@mutant(
    "ep_expert_grads_mean_over_efsdp",
    "expert gradients averaged over the expert-data-parallel group (FSDP's default), not over dp x cp: ep times too large",
    "strategies/fsdp.py: apply_expert_fsdp (divide_factor)",
)
def _ep_efsdp_mean(p: _Patcher) -> None:
    from lit_titan.strategies import strategy

    original = strategy.apply_expert_fsdp

    def apply_expert_fsdp(experts, mesh, precision, cfg, divide_factor):
        original(experts, mesh, precision, cfg, divide_factor=mesh.size())

    p.set(strategy, "apply_expert_fsdp", apply_expert_fsdp)


@mutant(
    "ep_tp_router_grad_not_reduced",
    "under ep x tp each tp rank takes its share of the routing weights as a plain slice: its router gradient holds "
    "only its own share of the tokens (partial over tp) and is never reduced over tp",
    "strategies/expert_parallel.py: split_over_tp",
)
def _ep_tp_router_partial(p: _Patcher) -> None:
    from lit_titan.strategies import expert_parallel

    original = expert_parallel.split_over_tp

    def split_over_tp(t, tp_mesh):
        if t.shape[-1] != 1:  # the tokens: as written; the routing weights [n, 1]: a slice, no gather in backward
            return original(t, tp_mesh)
        return t.chunk(tp_mesh.size())[tp_mesh.get_local_rank()]

    p.set(expert_parallel, "split_over_tp", split_over_tp)


@mutant(
    "moe_tp_swaps_expert_weights",
    "the tp style of the MoE layer swaps every DTensor weight under it for its local tensor during forward, the "
    "routed experts' too (an FSDP unit of their own under ep): the restore puts a stale sharded parameter back, "
    "which the next pipeline micro-batch trains directly, outside FSDP's gradient division",
    "models/qwen3_moe/parallelize.py: local_weights",
)
def _moe_tp_swaps_expert_weights(p: _Patcher) -> None:
    from lit_titan.models.qwen3_moe import parallelize

    original = parallelize.local_weights

    def local_weights(module, inputs, mesh):  # every DTensor under the layer, whatever its mesh
        meshes = {id(t.device_mesh): t.device_mesh for t in module.parameters() if hasattr(t, "device_mesh")}
        swapped = []
        for m in meshes.values():
            original(module, inputs, m)
            swapped += module._replicated_params
        module._replicated_params = swapped

    p.set(parallelize, "local_weights", local_weights)


@mutant(
    "expert_bias_from_one_rank",
    "the auxiliary-loss-free expert bias moves by each rank's own token counts (not summed over the batch group)",
    "module.py: PretrainModule.on_before_optimizer_step (update_expert_bias's group)",
)
def _bias_one_rank(p: _Patcher) -> None:
    import lit_titan.module as module

    original = module.update_expert_bias
    p.set(module, "update_expert_bias", lambda model, group=None: original(model, None))


@mutant(
    "pp_aux_loss_unscaled",
    "under pipeline parallel each MoE layer back-propagates its auxiliary loss without the pipeline's loss scale "
    "(1 / (micro-batches x accumulation))",
    "models/moe.py: MoE._inject_aux_loss (add_to_backward's scale)",
)
def _pp_aux_unscaled(p: _Patcher) -> None:
    from lit_titan.models import moe

    original = moe.add_to_backward
    p.set(moe, "add_to_backward", lambda hidden, term, scale: original(hidden, term, 1.0))


@mutant(
    "step_counts_one_rank",
    "with model.moe.aux_loss_counts=step the step's token counts are this rank's only (not summed over the batch "
    "group)",
    "strategies/step.py: StepRunner.train (count_step_tokens's group)",
)
def _step_counts_one_rank(p: _Patcher) -> None:
    from lit_titan.strategies import step

    original = step.count_step_tokens
    p.set(step, "count_step_tokens", lambda model, forwards, group=None: original(model, forwards, None))
