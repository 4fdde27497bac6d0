"""Non-finite loss / gradient guard: stop before the update (the default), or skip the step.

One NaN in a step's loss or gradients reaches every weight through the optimizer and, with AdamW,
its moment estimates: the run is lost from that step on, often noticed hours later, and its
checkpoints replace good ones. The guard is on by default (``nonfinite:`` in conf/train.yaml, not
part of the replaceable ``callbacks`` list) and checks each optimizer step *before* the update:

- ``action="stop"`` (default): raises :class:`~lit_titan.errors.NonFiniteError` naming the step,
  the quantity and its value; the command line prints that one line and exits with
  ``NONFINITE_EXIT_CODE`` (3);
- ``action="skip_step"``: drops the update (every gradient set to ``None``, so AdamW leaves the
  parameters *and* its state untouched: it skips parameters without gradients), counts it in
  ``train/skipped_steps`` and stops after ``max_consecutive_skips`` skipped steps in a row.

When: after the step's closure (forward, backward, the callbacks' and the module's
``on_before_optimizer_step``, clipping) returns and before the optimizer updates, through an
optimizer step pre-hook that wraps the closure. By then ``PretrainModule`` has computed the
*global* gradient norm (every step: clipping needs it), identical on every rank and NaN/Inf when
any rank's shard holds a NaN/Inf, so the guard reads it instead of taking a norm of its own. The
step's loss (each micro-batch's, summed on device as it goes, and ``PretrainModule``'s step mean)
is per rank, so one all-reduce of three numbers (ranks with a bad loss, ranks with a bad gradient,
the bad loss value) makes the decision identical everywhere; the guard's per-step cost is that
all-reduce and one device-to-host read of it (the one host sync it adds to steps that do not log:
it must decide before the update). The module still logs the step's real ``train/grad_norm`` and
``train/loss`` (a skipped step's row shows why). On a skipped step the LR scheduler still steps
and ``global_step`` still advances (the step's batch is consumed, not retried). Not meant for fp16
with a GradScaler, which skips overflowing steps itself (precision here is 32-true or bf16).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from lit_titan.callbacks.settings import NONFINITE_ACTIONS as ACTIONS
from lit_titan.callbacks.settings import NonFiniteConfig
from lit_titan.errors import NonFiniteError
from lit_titan.observe.log_cadence import is_logging_step
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import module_contract

__all__ = ["ACTIONS", "NonFiniteError", "NonFiniteGuard"]


class NonFiniteGuard(L.Callback):
    """Stop at (or skip) optimizer steps whose loss or gradient norm is NaN/Inf, identically on all ranks.

    Takes the ``nonfinite`` group (``NonFiniteConfig``; its ``enabled`` is read by job/build.py) or its
    fields by name:
        action: ``"stop"`` raises ``NonFiniteError`` before the update; ``"skip_step"`` drops the update.
        max_consecutive_skips: with ``"skip_step"``, raise after this many skipped steps in a row
            (a run that keeps producing NaNs will not recover by skipping).
    Not config keys: ``check_loss`` / ``check_grads``, which quantities to check.
    """

    def __init__(
        self,
        settings: NonFiniteConfig | None = None,
        *,
        check_loss: bool = True,
        check_grads: bool = True,
        **keys: Any,
    ) -> None:
        s = self.settings = settings_of(NonFiniteConfig, settings, keys)
        action, max_consecutive_skips = s.action, s.max_consecutive_skips
        if action not in ACTIONS:
            raise ValueError(
                f"NonFiniteGuard action={action!r}; choose 'stop' (raise before the update) or "
                f"'skip_step' (drop the update)"
            )
        if max_consecutive_skips < 1:
            raise ValueError("NonFiniteGuard max_consecutive_skips must be >= 1")
        self.action = action
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.check_loss = check_loss
        self.check_grads = check_grads
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.skipped_at: list[int] = []  # global steps whose update was dropped
        self._loss_sum: Tensor | None = None  # this step's micro-batch losses, summed on device (NaN/Inf stays)
        self._step_loss: Tensor | None = None  # captured in on_before_optimizer_step, checked after the closure
        self._pending = False  # a step's closure reached on_before_optimizer_step: decide when it returns
        self._decided = False  # a decision was taken in this batch (log train/skipped_steps at its end)
        self._trainer: L.Trainer | None = None
        self._hooks: list[Any] = []

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.consecutive_skips = 0
        self._loss_sum, self._step_loss, self._pending = None, None, False
        self._trainer = trainer
        self._remove_hooks()
        for optimizer in trainer.optimizers:
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer
            self._hooks.append(optimizer.register_step_pre_hook(self._wrap_closure))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_hooks()
        self._trainer = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        # Every micro-batch's loss (modules other than PretrainModule); not called under pipeline
        # parallelism, where PretrainModule's step loss covers it. Kept on device: no sync here.
        if self.check_loss:
            loss = _local(loss.detach()).float().sum()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Runs before the module's hook, which resets its step loss: read it now, decide later.
        losses = [] if self._loss_sum is None else [self._loss_sum]
        step_loss = module_contract(pl_module).step_mean_loss
        if step_loss is not None:
            losses.append(step_loss.detach().float())  # PretrainModule's step mean (also under PP)
        self._loss_sum = None
        # the first non-finite of them, else the step mean (on device, no sync)
        self._step_loss = _first_nonfinite(losses) if losses and self.check_loss else None
        self._pending = True
        if not self._hooks:  # no closure hook (step() called outside fit's loop): decide now
            self._decide(trainer, pl_module, optimizer, after_module=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # a dense column: 0, 0, 1, 1, ... (cumulative), in every row (logging steps only: logging a
        # Python number copies it to the device, a host sync on GPU)
        if self._decided and self.action == "skip_step" and is_logging_step(trainer, trainer.global_step):
            pl_module.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)
        self._decided = False

    # ---- the decision ---------------------------------------------------------------------------
    def _decide(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer, after_module: bool
    ) -> bool:
        """Whether this step's update must be dropped; raises ``NonFiniteError`` to stop. Collective."""
        self._pending, self._decided = False, True
        device = trainer.strategy.root_device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        loss = self._step_loss.to(device) if self._step_loss is not None else zero
        self._step_loss = None
        loss_bad = (~torch.isfinite(loss)).float()
        norm, norm_global = zero, False
        if self.check_grads:
            module_norm = module_contract(pl_module).last_grad_norm if after_module else None
            if module_norm is not None:  # PretrainModule's global norm: identical on every rank
                norm, norm_global = _local(module_norm.detach()).float().to(device), True
            else:
                norm = _local_grad_norm(optimizer, device)
        grad_bad = (~torch.isfinite(norm)).float()
        # ranks with a bad loss, ranks with a bad gradient, the bad losses' sum (NaN/Inf survives the sum)
        flags = torch.stack([loss_bad, grad_bad, torch.where(loss_bad > 0, loss, zero)])
        world = _world_size()
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        n_loss, n_grad, bad_loss, grad_norm = torch.cat([flags, norm.reshape(1)]).tolist()  # the one host sync
        if norm_global and n_grad:
            n_grad = world  # every rank holds the same global norm
        step = trainer.global_step
        if not (n_loss or n_grad):
            self.consecutive_skips = 0
            return False
        found = [f"loss {bad_loss}" if n_loss else "", f"grad norm {grad_norm}" if n_grad else ""]
        what = ", ".join(f for f in found if f)
        ranks = f" on {int(n_loss)} of {world} ranks" if world > 1 and n_loss and not n_grad else ""
        if self.action == "stop":
            raise NonFiniteError(
                f"non-finite {what} at optimizer step {step}{ranks}: stopped before the update "
                f"(nonfinite.action=stop), every checkpoint saved so far is kept; lower optim.lr or "
                f"check the data and resume=auto, or set nonfinite.action=skip_step to drop such steps"
            )
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.skipped_at.append(step)
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"non-finite {what} at optimizer step {step}{ranks}: {self.consecutive_skips} "
                f"consecutive steps skipped (nonfinite.max_consecutive_skips="
                f"{self.max_consecutive_skips}); stopping: the run is diverging, resume from an "
                f"earlier checkpoint with a lower learning rate or check the data"
            )
        if trainer.is_global_zero:
            print(
                f"lit-titan: NonFiniteGuard skipped optimizer step {step}: non-finite {what}{ranks} "
                f"({self.consecutive_skips} in a row, {self.skipped_steps} in total)",
                flush=True,
            )
        return True

    # ---- helpers --------------------------------------------------------------------------------
    def _wrap_closure(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Optimizer step pre-hook: run the closure, then decide (and drop the gradients of a skipped step)."""
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is None:
            return None

        def closure_then_decide() -> Any:
            result = closure()
            trainer = self._trainer
            if (
                self._pending
                and trainer is not None
                and self._decide(trainer, trainer.lightning_module, optimizer, after_module=True)
            ):
                _drop_grads(optimizer)
            return result

        if "closure" in kwargs or not args:
            return args, {**kwargs, "closure": closure_then_decide}
        return (closure_then_decide, *args[1:]), kwargs

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _first_nonfinite(values: list[Tensor]) -> Tensor:
    """The first non-finite of these scalars, else the last one; on device, no sync."""
    out = values[-1]
    for v in reversed(values[:-1]):
        out = torch.where(torch.isfinite(v), out, v.to(out.device))
    return out


def _local_grad_norm(optimizer: torch.optim.Optimizer, device: torch.device) -> Tensor:
    """This rank's gradient norm (modules that compute no global one): NaN/Inf anywhere shows in it."""
    grads = [_local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float().to(device) for n in torch._foreach_norm(grads)])
    return torch.linalg.vector_norm(norms)


def _drop_grads(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None  # AdamW (and Adam, SGD) leave parameters without a gradient, and their state, untouched


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (no communication), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
