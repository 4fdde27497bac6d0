"""Non-finite loss / gradient guard: skip the optimizer step, or stop with a clear message.

One NaN in a step's loss or gradients reaches every weight through the optimizer and, with AdamW,
its moment estimates: the run is lost from that step on, often noticed hours later. The guard
checks each optimizer step *before* the update and either

- ``action="skip"``: drops the update (every gradient set to ``None``, so AdamW leaves the
  parameters *and* its state untouched: it skips parameters without gradients), counts it in
  ``train/skipped_steps`` and stops after ``max_consecutive_skips`` skipped steps in a row; or
- ``action="stop"``: raises :class:`NonFiniteError` naming the step and the quantity.

The decision is identical on every rank: each rank checks its loss and its local gradient shards,
then one all-reduce of two flags over the world group combines them (a NaN in one rank's shard is
a NaN in the global gradient norm). Cost per optimizer step: a foreach norm of the local
gradients, that all-reduce, and one device-to-host copy of the two flags: the guard decides before
the update, so unlike logging it cannot wait for a logging step (it is the one host sync it adds to
steps that do not log; ``train/skipped_steps`` is logged on logging steps only).

Hook order: Lightning runs ``optimizer.step(closure)``; the closure runs forward/backward, then the
callbacks' ``on_before_optimizer_step``, then the module's (``PretrainModule`` computes the global
grad norm and logs the step's loss there), then gradient clipping; after the closure returns the
optimizer updates. The guard decides in its ``on_before_optimizer_step`` (reading the step's loss
from ``PretrainModule`` before the module resets it) but drops the gradients only when the closure
has returned, through an optimizer step pre-hook that wraps the closure: the module still sees the
real gradients, logs the non-finite ``train/grad_norm`` and ``train/loss`` of the skipped step, and
never reduces a norm over an empty gradient list. The LR scheduler still steps and
``global_step`` still advances (the step's batch is consumed, not retried). Not meant for fp16 with
a GradScaler, which skips overflowing steps itself (precision here is 32-true or bf16).
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from lit_titan.log_cadence import is_logging_step

__all__ = ["NonFiniteError", "NonFiniteGuard"]


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient stopped training (``NonFiniteGuard``)."""


class NonFiniteGuard(L.Callback):
    """Skip (or stop at) optimizer steps whose loss or gradients are NaN/Inf, identically on all ranks.

    Args:
        action: ``"skip"`` drops the update and continues; ``"stop"`` raises ``NonFiniteError``.
        max_consecutive_skips: with ``"skip"``, raise after this many skipped steps in a row
            (a run that keeps producing NaNs will not recover by skipping).
        check_loss / check_grads: which quantities to check.
    """

    def __init__(self, action: Literal["skip", "stop"] = "skip", max_consecutive_skips: int = 5,
                 check_loss: bool = True, check_grads: bool = True) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"NonFiniteGuard action={action!r}; choose 'skip' (drop the update) or 'stop' (raise)")
        if max_consecutive_skips < 1:
            raise ValueError("NonFiniteGuard max_consecutive_skips must be >= 1")
        self.action = action
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.check_loss = check_loss
        self.check_grads = check_grads
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.skipped_at: list[int] = []  # global steps whose update was dropped
        self._loss_bad: Tensor | None = None  # non-finite loss seen in this step's backward passes
        self._drop_grads = False  # set by the decision, applied when the optimizer's closure returns
        self._hooks: list[Any] = []

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.consecutive_skips = 0
        self._loss_bad, self._drop_grads = None, False
        self._remove_hooks()
        for optimizer in trainer.optimizers:
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer
            self._hooks.append(optimizer.register_step_pre_hook(self._wrap_closure))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        # Every micro-batch's loss (modules other than PretrainModule); not called under pipeline
        # parallelism, where PretrainModule's step loss covers it. Kept on device: no sync here.
        if self.check_loss:
            bad = ~torch.isfinite(_local(loss.detach())).all()
            self._loss_bad = bad if self._loss_bad is None else (self._loss_bad | bad)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        device = trainer.strategy.root_device
        loss_bad, grad_bad = self._local_flags(pl_module, optimizer, device)
        self._loss_bad = None
        flags = torch.stack([loss_bad, grad_bad]).to(device=device, dtype=torch.float32)
        world = _world_size()
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.SUM)  # ranks that saw each problem
        n_loss, n_grad = (int(v) for v in flags.tolist())  # the one device-to-host sync
        step = trainer.global_step
        if not (n_loss or n_grad):
            self.consecutive_skips = 0
            self._log(pl_module)
            return
        what = " and ".join(q for q, n in (("loss", n_loss), ("gradient (global grad norm)", n_grad)) if n)
        ranks = f" on {max(n_loss, n_grad)} of {world} ranks" if world > 1 else ""
        if self.action == "stop":
            raise NonFiniteError(f"non-finite {what} at optimizer step {step} (global_step before the update)"
                                 f"{ranks}; stopping before the update (NonFiniteGuard action=stop). Use "
                                 f"action=skip to drop such steps, or lower the learning rate / check the data.")
        if self._hooks:
            self._drop_grads = True  # after the module's norm and clipping, before the update
        else:  # no closure hook (step() called outside fit's loop): drop now
            _drop_grads(optimizer)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.skipped_at.append(step)
        self._log(pl_module)
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteError(f"non-finite {what} at optimizer step {step}{ranks}: {self.consecutive_skips} "
                                 f"consecutive steps skipped (max_consecutive_skips={self.max_consecutive_skips}); "
                                 f"stopping: the run is diverging, resume from an earlier checkpoint with a lower "
                                 f"learning rate or check the data")
        if trainer.is_global_zero:
            print(f"lit-titan: NonFiniteGuard skipped optimizer step {step}: non-finite {what}{ranks} "
                  f"({self.consecutive_skips} in a row, {self.skipped_steps} in total)", flush=True)

    # ---- helpers --------------------------------------------------------------------------------
    def _wrap_closure(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Optimizer step pre-hook: run the closure, then drop the gradients if the step is skipped."""
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is None:
            return None

        def closure_then_drop() -> Any:
            result = closure()
            if self._drop_grads:
                self._drop_grads = False
                _drop_grads(optimizer)
            return result

        if "closure" in kwargs or not args:
            return args, {**kwargs, "closure": closure_then_drop}
        return (closure_then_drop, *args[1:]), kwargs

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _local_flags(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer,
                     device: torch.device) -> tuple[Tensor, Tensor]:
        false = torch.zeros((), dtype=torch.bool, device=device)
        loss_bad = false
        if self.check_loss:
            if self._loss_bad is not None:
                loss_bad = loss_bad | self._loss_bad.to(device)
            # PretrainModule's mean loss of this step (also under pipeline parallelism), read before
            # its own on_before_optimizer_step resets it.
            step_loss, micro = getattr(pl_module, "_step_loss", None), getattr(pl_module, "_micro_batches", 0)
            if isinstance(step_loss, Tensor) and micro:
                loss_bad = loss_bad | ~torch.isfinite(step_loss.detach().to(device)).all()
        grad_bad = false
        if self.check_grads:
            grads = [_local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            grads = [g for g in grads if g.numel()]
            if grads:
                norms = torch._foreach_norm(grads)  # NaN or Inf anywhere in a tensor shows in its norm
                grad_bad = ~torch.isfinite(torch.stack([n.float().to(device) for n in norms])).all()
        return loss_bad, grad_bad

    def _log(self, pl_module: L.LightningModule) -> None:
        # a dense column: 0, 0, 1, 1, ... (cumulative), in every row (logging steps only: logging a
        # Python number copies it to the device, a host sync on GPU)
        if self.action == "skip" and is_logging_step(pl_module.trainer, pl_module.trainer.global_step + 1):
            pl_module.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)


def _drop_grads(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None  # AdamW (and Adam, SGD) leave parameters without a gradient, and their state, untouched


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (no communication), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

