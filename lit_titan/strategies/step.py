"""One optimizer step of one rank: the only owner of micro-batches, backward and the loss normaliser.

Under ``TitanStrategy`` one Lightning batch is the rank's whole step (Lightning never accumulates). The runner
splits it into micro-batches, zeroes the gradients once, counts the step's valid targets over every rank that
holds part of the global batch (data x context parallel) before the first backward, and back-propagates each
micro-batch's loss weighted by its share of them. So the gradient is the sum of every valid target's loss over
the global count, whatever the layout, the accumulation or the labels a subclass ignores: a per-rank or
per-micro-batch mean (what averaging means would give) differs from one device as soon as counts differ.
TorchTitan's ``train_step`` is the precedent (global valid tokens, one loop owning the step).

What varies by layout is a hook, not a loop: a micro-batch is trained by the model itself, by one step of the
pipeline schedule, or (replica fault tolerance) by ``ReplicaStep`` with its own factor.

The contract of a ``compute_loss`` (``PretrainModule``): a scalar is the mean over the micro-batch's valid
targets (what ``F.cross_entropy(..., ignore_index=-100)`` returns; ``count_targets`` counts them), a tensor
shaped like the labels is per-target losses (zero where ignored), summed. Anything else is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_titan.models.moe import count_step_tokens, forget_step_counts, take_aux_term
from lit_titan.observe.phases import phase

IGNORE_INDEX = -100  # the label torch's cross-entropy ignores by default, and so the runner's count

Part = tuple[Tensor, Tensor, dict[str, Tensor]]


def count_valid(labels: Tensor) -> Tensor:
    """Targets that count in the loss: every label but ``IGNORE_INDEX`` (an int64 device scalar, no host read)."""
    return (labels != IGNORE_INDEX).sum()


def weigh(loss: Tensor, labels: Tensor, count: Tensor, factor: Tensor) -> Tensor:
    """``loss`` (a mean over ``count`` valid targets, or per-target losses shaped like ``labels``) as its sum
    times ``factor``: the micro-batch's part of the step's normalised loss."""
    if loss.ndim == 0:
        return loss * (count * factor).to(loss.dtype)
    if tuple(loss.shape) in (tuple(labels.shape), (labels.numel(),)):
        return loss.sum() * factor.to(loss.dtype)
    raise TypeError(
        f"compute_loss returned a tensor of shape {tuple(loss.shape)} for labels of shape {tuple(labels.shape)}: "
        f"return the mean over the valid targets (a scalar) or one loss per target (the labels' shape)"
    )


def micro_parts(inputs: Tensor, labels: Tensor, extra: dict[str, Tensor], micro: int) -> list[Part]:
    """The rank's step as micro-batches of ``micro`` sequences (per-token ``extra`` sliced alike)."""
    return [
        (inputs[i : i + micro], labels[i : i + micro], {k: v[i : i + micro] for k, v in extra.items()})
        for i in range(0, inputs.shape[0], micro)
    ]


class StepRunner:
    """Trains and evaluates one rank's whole step for ``TitanStrategy`` (``strategy``: its answers)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    # ---- the normaliser ---------------------------------------------------------------------------
    def global_count(self, module: Any, parts: list[Part], async_op: bool = False) -> tuple[Tensor, Any]:
        """This rank's valid targets summed over the ranks sharing the global batch (dp x cp); the pending
        all-reduce when ``async_op`` (waited for before the first backward, so it overlaps the first forward)."""
        counts = [module.count_targets(y) for _, y, _ in parts]
        total = torch.stack(counts).sum()
        group = self.strategy.batch_group
        work = dist.all_reduce(total, group=group, async_op=async_op) if group is not None else None
        return total, work

    def average_divisor(self) -> int:
        """What the gradient reduction divides by: FSDP/HSDP average over the ranks sharing the batch."""
        group = self.strategy.batch_group
        return dist.get_world_size(group) if group is not None else 1

    def micro_size(self, module: Any, rows: int) -> int:
        """Sequences per micro-batch: the job's (``PretrainModule.step_micro_batch``), the data module's, or
        the rank's whole batch split in Lightning's ``accumulate_grad_batches`` (the strategy takes it over)."""
        if module.step_micro_batch:
            return int(module.step_micro_batch)
        data = getattr(module.trainer, "datamodule", None)
        micro = getattr(data, "step_micro_batch_size", None)
        if micro:
            return int(micro)
        parts = max(1, int(getattr(self.strategy, "absorbed_accumulation", 1)))
        if rows % parts:
            raise ValueError(
                f"accumulate_grad_batches={parts}: the rank's batch of {rows} sequences does not split into "
                f"{parts} micro-batches; choose a divisor of {rows}"
            )
        return rows // parts

    # ---- training ---------------------------------------------------------------------------------
    def split(self, module: Any, batch: Any) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """(whole inputs, this rank's inputs and labels, the model's per-token inputs): context parallel
        gives each rank its slice of every sequence; ``inputs_and_labels`` makes the labels."""
        inputs, labels, extra = module.inputs_and_labels(batch)
        local_inputs, local_labels = self.strategy._shard_sequence(inputs, labels, extra)
        return inputs, local_inputs, local_labels, extra

    def train(self, module: Any, batch: Any) -> Tensor:
        """Forward and backward of the rank's whole step; the step's loss (detached, as logged)."""
        for optimizer in module.trainer.optimizers:
            optimizer.zero_grad()
        if self.strategy.replica_step is not None:  # replica groups: which samples a rank trains may change
            return self.strategy.replica_step.run(module, batch, self)
        inputs, local_inputs, labels, extra = self.split(module, batch)
        micro = self.micro_size(module, local_inputs.shape[0])
        parts = micro_parts(local_inputs, labels, extra, micro)
        module._micro_batches_per_batch = len(parts)
        total, work = self.global_count(module, parts, async_op=True)
        if _counts_whole_step(module):  # an MoE's global-batch loss needs the step's tokens per expert first
            forward = self._pipeline_eval(module) if self.strategy.pipeline is not None else module.model_loss
            count_step_tokens(
                module.model,
                [lambda x=x, y=y, kw=kw: forward(x, y, **kw) for x, y, kw in parts],
                self.strategy.batch_group,
            )
        factor, pending = self._factor(module, total, work)
        try:
            for j, (x, y, kw) in enumerate(parts):
                with self._no_sync(last=j == len(parts) - 1):
                    loss = self.train_part(module, x, y, kw, factor, aux_weight=1.0 / len(parts))
                whole = inputs[j * micro : (j + 1) * micro]
                # what record_train_loss averages over micro-batches and ranks: the step's normalised loss
                module.record_train_loss(loss * len(parts), whole)
        finally:
            if pending is not None:
                pending.remove()
            forget_step_counts(module.model)
        return module.step_mean_loss

    def _factor(self, module: Any, total: Tensor, work: Any) -> tuple[Tensor, Any]:
        """The normaliser's factor, and the hook that fills it in: without pp, the count's all-reduce is waited for
        when the model's forward starts (its wait falls inside the model, at its first collective: the time before a
        forward must not synchronise ranks, which the straggler report relies on); the schedule's stages are other
        modules, so under pp it is waited for here."""
        divisor = self.average_divisor()
        if self.strategy.pipeline is not None:
            if work is not None:
                work.wait()
            return divisor / total.to(torch.float64), None
        factor = torch.empty((), dtype=torch.float64, device=total.device)

        def fill(*_: Any) -> None:
            if work is not None:
                work.wait()
            factor.copy_(divisor / total.to(torch.float64))
            handle.remove()

        handle = module.model.register_forward_pre_hook(fill)
        return factor, handle

    def train_part(
        self,
        module: Any,
        x: Tensor,
        y: Tensor,
        kw: dict[str, Tensor],
        factor: Tensor,
        aux_weight: float,
        sum_over_stages: bool | None = None,
    ) -> Tensor:
        """Forward and backward of one micro-batch: its loss weighted by ``factor`` per valid target, the model's
        auxiliary loss by ``aux_weight``; returns that weighted loss, detached. Under pp it is the last stage's
        (zero elsewhere), summed over the stages on logging steps unless ``sum_over_stages`` says otherwise."""
        pipeline = self.strategy.pipeline
        if pipeline is not None:
            logging = _is_logging_step(module) if sum_over_stages is None else sum_over_stages

            def weighted(loss: Tensor, target: Tensor) -> Tensor:
                return weigh(loss, target, module.count_targets(target), factor)

            return pipeline.train_step(
                x,
                y,
                module.compute_loss,
                weigh=weighted,
                aux_scale=aux_weight / pipeline.microbatches,
                sum_over_stages=logging,
                loss_in_model=module.loss_in_model,
                model_kwargs=kw,
            )
        clock = module.phase_clock
        if clock is not None:
            clock.end("data")
        with phase(clock, "forward"):
            loss = module.model_loss(x, y, **kw)
            count = module.count_targets(y)
            aux = take_aux_term(module.model)  # inside ``loss``; it counts per micro-batch, not per target
            loss = weigh(loss, y, count, factor)
            if aux is not None:
                loss = loss + aux * (aux_weight - (count * factor).to(aux.dtype))
        with phase(clock, "backward"):
            loss.backward()
        return _plain(loss.detach()).to(torch.promote_types(loss.dtype, torch.float32))

    def _no_sync(self, last: bool):
        return nullcontext() if last else self.strategy.block_backward_sync()

    def _pipeline_eval(self, module: Any) -> Callable[..., Tensor]:
        pipeline = self.strategy.pipeline
        return lambda x, y, **kw: pipeline.eval_step(
            x, y, module.compute_loss, loss_in_model=module.loss_in_model, model_kwargs=kw
        )

    # ---- evaluation -------------------------------------------------------------------------------
    def evaluate(self, module: Any, batch: Any) -> Tensor:
        """The loss of one validation batch: every rank's valid targets over their global count, in micro-batches
        (no gradients, so nothing moves: no expert-bias counts, no auxiliary-loss state)."""
        _, local_inputs, labels, extra = self.split(module, batch)
        parts = micro_parts(local_inputs, labels, extra, self.micro_size(module, local_inputs.shape[0]))
        total, _ = self.global_count(module, parts)
        factor = self.average_divisor() / total.to(torch.float64)
        pipeline = self.strategy.pipeline
        losses: list[Tensor] = []
        for x, y, kw in parts:
            if pipeline is not None:

                def weighted(loss: Tensor, target: Tensor) -> Tensor:
                    return weigh(loss, target, module.count_targets(target), factor)

                losses.append(
                    pipeline.eval_step(
                        x, y, module.compute_loss, loss_in_model=module.loss_in_model, model_kwargs=kw, weigh=weighted
                    )
                )
            else:
                # without gradients an MoE model adds no auxiliary loss: val/loss is the LM loss alone
                loss = weigh(module.model_loss(x, y, **kw), y, module.count_targets(y), factor)
                losses.append(_plain(loss.detach()).to(torch.promote_types(loss.dtype, torch.float32)))
        return torch.stack(losses).sum()


def _counts_whole_step(module: Any) -> bool:
    """Decided from the model's arguments, the same on every pipeline stage (each must join the forwards)."""
    moe = getattr(module.model_args, "moe", None)
    return bool(moe is not None and moe.counts_whole_step)


def _is_logging_step(module: Any) -> bool:
    from lit_titan.observe.log_cadence import is_logging_step

    return is_logging_step(module.trainer, module.global_step + 1)


def _plain(t: Tensor) -> Tensor:
    """A replicated DTensor (the loss under loss parallel) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
