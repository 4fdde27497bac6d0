"""Pipeline parallelism: stage split, stage placement, and the schedule runner.

A stage is the model with the other parts removed (``Transformer`` tolerates missing blocks,
embedding, norm and head), so parameter names, and hence checkpoints, do not depend on the
layout. A rank holding several stages (interleaved / V schedules) owns one *rank model*: the
union of its stages, under the original names (what the optimizer, logging and checkpoints
see); each stage is a *view* sharing that rank model's submodules.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_titan.models.injected_loss import losses_in_backward
from lit_titan.strategies.parallel_dims import LayoutError
from lit_titan.strategies.settings import LOOPED, PP_SCHEDULES, SINGLE_STAGE, V_SHAPED

# Split backward into input- and weight-gradients; with FSDP they need reshard_after_forward=False
# inside stages (else one stage's gradients are wrong or missing, silently), which TitanStrategy therefore
# always uses under PP.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1F1B"
    microbatches: int | None = None  # splits of the rank-local batch; default: the number of stages
    stages_per_rank: int | None = None  # default: 1 for GPipe/1F1B, 2 otherwise
    stages: tuple[tuple[str, ...], ...] | None = None  # explicit split: module names per stage

    def validate(self, pp: int | None = None, n_units: int | None = None, local_batch: int | None = None) -> None:
        """Schedule, stages per rank, and (when given) stage count and micro-batch split."""
        if self.schedule not in PP_SCHEDULES:
            raise LayoutError(f"unknown parallel.pp_schedule={self.schedule!r}; choose one of {PP_SCHEDULES}")
        per_rank = self.per_rank
        if self.schedule in SINGLE_STAGE and per_rank != 1:
            raise LayoutError(
                f"parallel.pp_schedule={self.schedule} runs one stage per rank; set "
                f"parallel.pp_stages_per_rank=1 or pick Interleaved1F1B/LoopedBFS"
            )
        if self.schedule in V_SHAPED and per_rank != 2:
            raise LayoutError(
                f"parallel.pp_schedule={self.schedule} needs exactly 2 stages per rank (V shape); "
                f"set parallel.pp_stages_per_rank=2"
            )
        if self.schedule in LOOPED and per_rank < 2:
            raise LayoutError(
                f"parallel.pp_schedule={self.schedule} needs >= 2 stages per rank; set "
                f"parallel.pp_stages_per_rank=2 or use 1F1B/GPipe"
            )
        if pp is not None and n_units is not None and n_units < pp * per_rank:
            raise LayoutError(
                f"parallel.pp={pp}: {n_units} pipeline units (embedding, blocks, head) cannot fill pp "
                f"x stages per rank = {pp * per_rank} stages; lower parallel.pp or "
                f"parallel.pp_stages_per_rank"
            )
        microbatches = self.microbatches_for(pp) if pp else None
        if pp and self.schedule == "DualPipeV" and microbatches < pp * per_rank:
            raise LayoutError(
                f"parallel.pp_microbatches={microbatches}: DualPipeV needs at least as many micro-batches "
                f"as stages ({pp * per_rank}); raise parallel.pp_microbatches (the per-rank batch must "
                f"split into them)"
            )
        if local_batch is not None and microbatches and local_batch % microbatches:
            raise LayoutError(
                f"parallel.pp_microbatches={microbatches}: the per-rank batch of {local_batch} "
                f"sequences does not split into {microbatches} micro-batches; change data.micro_batch_size, "
                f"data.global_batch_size or parallel.pp_microbatches"
            )

    def microbatches_for(self, pp: int) -> int:
        """Pipeline micro-batches per step: as configured, else one per stage (pp x stages per rank)."""
        return int(self.microbatches or pp * self.per_rank)

    @property
    def per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return int(self.stages_per_rank)
        return 1 if self.schedule in SINGLE_STAGE else 2


def stage_ids(pp_rank: int, pp: int, cfg: PipelineConfig) -> list[int]:
    """Stages on this rank: looped (r, r+pp, ...) or V-shaped (r, 2*pp-1-r)."""
    if cfg.schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(cfg.per_rank)]


def split_units(
    units: list[list[str]], num_stages: int, explicit: tuple[tuple[str, ...], ...] | None = None
) -> list[list[str]]:
    """Module names per stage: contiguous, balanced by unit count, or checked ``explicit``."""
    flat = [name for unit in units for name in unit]
    if explicit is not None:
        stages = [list(s) for s in explicit]
        if len(stages) != num_stages:
            raise LayoutError(f"parallel.pp_stages lists {len(stages)} stages but pp x stages per rank = {num_stages}")
        if [n for s in stages for n in s] != flat:
            raise LayoutError(f"parallel.pp_stages must list every module once, in order: {flat}")
        return stages
    if len(units) < num_stages:
        raise LayoutError(
            f"{len(units)} pipeline units (embedding, {len(units) - 2} blocks, head) cannot fill "
            f"{num_stages} stages; lower parallel.pp or parallel.pp_stages_per_rank"
        )
    base, extra = divmod(len(units), num_stages)
    stages, start = [], 0
    for i in range(num_stages):
        size = base + (1 if i < extra else 0)
        stages.append([name for unit in units[start : start + size] for name in unit])
        start += size
    return stages


def prune(model: nn.Module, all_names: list[str], keep: set[str]) -> None:
    """Remove every listed submodule not in ``keep`` (ModuleDict entries deleted, others set to None)."""
    for name in all_names:
        if name in keep:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        else:
            setattr(parent, child, None)


def build_rank_model(
    model: nn.Module, units: list[list[str]], stage_names: list[list[str]]
) -> tuple[nn.Module, list[nn.Module]]:
    """The rank model (union of this rank's stages) and one view per stage sharing its modules."""
    all_names = [n for unit in units for n in unit]
    rank_model = model
    prune(rank_model, all_names, {n for names in stage_names for n in names})
    if len(stage_names) == 1:
        return rank_model, [rank_model]
    views = []
    for names in stage_names:
        # Shallow copy sharing the submodules (and so the parameters), but with its own tables of
        # children, parameters, buffers and hooks: FSDP/TP hooks on a view stay on that view.
        view = copy.copy(rank_model)
        view.__dict__ = {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in rank_model.__dict__.items()}
        for key, child in list(view._modules.items()):
            if isinstance(child, nn.ModuleDict):
                view._modules[key] = nn.ModuleDict({k: m for k, m in child.items() if f"{key}.{k}" in names})
            elif child is not None and key not in names:
                view._modules[key] = None
        views.append(view)
    return rank_model, views


def share_root_buffers(rank_model: nn.Module, views: list[nn.Module]) -> None:
    """After materialisation, views see the rank model's real root buffers (e.g. rope tables)."""
    for view in views:
        if view is not rank_model:
            view._buffers.update(rank_model._buffers)


class PipelineRunner:
    """Drives one torch pipeline schedule for the Lightning training and validation steps."""

    def __init__(
        self,
        views: list[nn.Module],
        ids: list[int],
        num_stages: int,
        cfg: PipelineConfig,
        pp_group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        self.stages = [PipelineStage(v, i, num_stages, device, group=pp_group) for v, i in zip(views, ids)]
        self.has_last = any(i == num_stages - 1 for i in ids)
        # The logged loss sum's dtype, the same on every stage (its all-reduce needs one): fp32 at least, float64
        # under precision=64-true. Fixed once the weights exist, so taken here, not every step.
        self._loss_dtype = torch.promote_types(next(views[0].parameters()).dtype, torch.float32)
        self.pp_group = pp_group
        self.microbatches = cfg.microbatches_for(dist.get_world_size(pp_group))
        self._loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
        self._weigh: Callable[[Tensor, Tensor], Tensor] = _unweighted
        self.schedule_name = cfg.schedule
        cls = get_schedule_class(cfg.schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        # scale_grads=False: the step runner's normaliser weighs each micro-batch's loss (its share of the
        # step's valid targets), instead of a mean over the schedule's micro-batches after each step.
        self.schedule = cls(
            self.stages[0] if single else self.stages,
            n_microbatches=self.microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=False,
        )
        self._step_kwargs = (
            {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        )

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return self._weigh(self._loss_fn(output, target), target)

    def _loss_sum(self, losses: list[Tensor], sum_over_stages: bool = True) -> Tensor:
        """The sum of the last stage's weighted micro-batch losses; the same on every pipeline rank when
        ``sum_over_stages`` (an all-reduce over the pp group), else zero off the last stage."""
        dtype = self._loss_dtype
        if self.has_last and losses:
            loss = torch.stack([_plain(loss.detach()).to(dtype) for loss in losses]).sum()
        else:
            # made on the device: a host-made zero would be a blocking copy to the GPU per micro-batch
            loss = torch.zeros((), dtype=dtype, device=self.stages[0].device)
        loss = loss.to(self.stages[0].device)
        if sum_over_stages:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)
        return loss

    def check_batch(self, local_batch: int) -> None:
        if local_batch % self.microbatches:
            raise LayoutError(
                f"the per-rank batch of {local_batch} sequences does not split into "
                f"parallel.pp_microbatches={self.microbatches}; change data.micro_batch_size or "
                f"parallel.pp_microbatches"
            )

    def train_step(
        self,
        inputs: Tensor,
        labels: Tensor,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        weigh: Callable[[Tensor, Tensor], Tensor],
        aux_scale: float,
        sum_over_stages: bool = True,
        loss_in_model: bool = False,
        model_kwargs: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Forward and backward of one micro-batch of the step runner through the pipeline; the sum of its
        schedule micro-batches' weighted losses (``strategies/step.py``).

        ``weigh(loss, target)``: a schedule micro-batch's loss as its part of the step's normalised loss (the
        step runner's global valid-target normaliser). ``aux_scale``: the weight of the loss terms a stage's
        layers make themselves (an MoE layer's auxiliary loss, per schedule micro-batch).
        ``sum_over_stages=False`` skips the loss all-reduce over the pp group (steps that do not log).
        ``loss_in_model``: the last stage's head computes the (chunked) loss from the labels, which
        the schedule passes to every stage as a keyword argument (split into micro-batches like
        the inputs; stages without the head ignore it), so its output is already the loss.
        ``model_kwargs`` (per-token ``positions`` / ``documents``, [b, s]) reach every stage the
        same way: each stage's blocks need them for rotary embeddings and the attention mask.
        """
        self.check_batch(inputs.shape[0])
        self._loss_fn, self._weigh = (_identity_loss if loss_in_model else loss_fn), weigh
        losses: list[Tensor] = []
        kwargs = {**(model_kwargs or {}), **({"labels": labels} if loss_in_model else {})}
        # Loss terms made inside a stage (an MoE layer's auxiliary loss) cannot reach the last stage's loss:
        # their layers back-propagate them with this scale (models/injected_loss.py).
        with losses_in_backward(aux_scale):
            self.schedule.step(inputs, target=labels, losses=losses, **kwargs, **self._step_kwargs)
        return self._loss_sum(losses, sum_over_stages)

    @torch.no_grad()
    def eval_step(
        self,
        inputs: Tensor,
        labels: Tensor,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        loss_in_model: bool = False,
        model_kwargs: dict[str, Tensor] | None = None,
        weigh: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """The schedule's forward of one micro-batch without gradients: the sum of its schedule micro-batches'
        losses, each weighted by ``weigh`` (default: the mean over them), on every pipeline rank."""
        if self.schedule_name in V_SHAPED:
            raise RuntimeError(
                f"validation under {self.schedule_name} fails in torch's schedule eval (\"can't "
                f"steal_bwd_input if this stage doesn't have backward\", torch 2.14); set "
                f"trainer.limit_val_batches=0 or use Interleaved1F1B"
            )
        if not hasattr(self.schedule, "eval"):
            raise RuntimeError(
                f"validation under pipeline parallelism needs torch >= 2.8 (found {torch.__version__});"
                f" set trainer.limit_val_batches=0"
            )
        self.check_batch(inputs.shape[0])
        self._loss_fn = _identity_loss if loss_in_model else loss_fn
        self._weigh = weigh or (lambda loss, target: loss / self.microbatches)
        losses: list[Tensor] = []
        kwargs = {**(model_kwargs or {}), **({"labels": labels} if loss_in_model else {})}
        # return_outputs=False (as in train_step): the last stage's outputs are its losses when the head makes the
        # loss, which torch cannot merge (0-d tensors)
        self.schedule.eval(inputs, target=labels, losses=losses, **kwargs, **self._step_kwargs)
        return self._loss_sum(losses)


def _unweighted(loss: Tensor, target: Tensor) -> Tensor:
    return loss


def _identity_loss(output: Tensor, target: Tensor) -> Tensor:
    """The last stage already returned the loss (its head computed it from the labels)."""
    return output


def _plain(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
