"""Host work at the logging cadence only: which optimizer steps log, and keeping the others sync-free.

On a GPU, every read of a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``), every
``torch.tensor(python_number, device="cuda")`` (a blocking host-to-device copy) and every
collective issued for bookkeeping stalls the host until the GPU has drained its queue, so the next
step's kernels start late. A training step that does not log should therefore do none of these;
the steps that log (every ``trainer.log_every_n_steps`` optimizer steps) may.

This module holds the three pieces every logger of the project uses:

- :func:`is_logging_step`: whether the optimizer step in progress writes a metrics row. It is
  decided from the step number alone, so every rank agrees and a reduction issued only on logging
  steps (``self.log(..., sync_dist=True)``) is called by all ranks or none.
- :func:`forget_logged`: drop values logged on an earlier step from Lightning's result collection.
  Lightning keeps an on-step value until the epoch ends and converts every ``prog_bar`` value to a
  Python number (``.item()``) after *every* batch, so a loss logged at step 10 would otherwise be
  read again at steps 11, 12, ...; it would also be written again in later rows.
- :func:`amortise_sigterm_check`: Lightning (2.6) broadcasts a SIGTERM flag from rank 0 and reads it
  with ``.item()`` before *every* training batch of a multi-process run; this runs that check on
  the first batch of logging steps only (a SIGTERM stops the job at most ``log_every_n_steps``
  optimizer steps later).
"""

from __future__ import annotations

import lightning as L

__all__ = ["amortise_sigterm_check", "forget_logged", "is_logging_step", "log_every"]


def log_every(trainer: L.Trainer) -> int:
    """``trainer.log_every_n_steps`` (0: never log)."""
    return int(getattr(trainer, "log_every_n_steps", 1) or 0)


def is_logging_step(trainer: L.Trainer, step: int) -> bool:
    """True when optimizer step ``step`` (1-based) writes a metrics row.

    Pass ``trainer.global_step + 1`` before the optimizer update (``training_step``,
    ``on_before_optimizer_step``) and ``trainer.global_step`` after it (``on_train_batch_end`` of the
    step's last micro-batch). Matches Lightning's own flush decision for single-optimizer training
    (``(batches_that_stepped + 1) % log_every_n_steps == 0``) but depends on the step number only, so
    every rank agrees.
    """
    every = log_every(trainer)
    return every > 0 and step % every == 0


def forget_logged(trainer: L.Trainer, prefix: str) -> None:
    """Drop on-step values whose name starts with ``prefix`` that were logged on an earlier step.

    Call it at the start of the next batch (the row of the logging step has been written by then).
    Uses Lightning's result collection (internal): if its shape changes, the old values stay and are
    read again (a host sync per batch on GPU, repeated values in rows); nothing else breaks.
    ``trainer.callback_metrics`` keeps the last values.
    """
    try:
        for item in (trainer._results or {}).values():
            if getattr(item.meta, "name", "").startswith(prefix) and not item.has_reset:
                item.reset()
    except Exception:  # pragma: no cover - a Lightning internals change: repeated values only
        pass


def amortise_sigterm_check(trainer: L.Trainer) -> bool:
    """Run Lightning's per-batch SIGTERM broadcast only on the first batch of logging steps.

    Returns whether Lightning's check was found and wrapped (idempotent). The decision uses only
    counters that are equal on every rank, so all ranks enter the broadcast on the same batch.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    original = getattr(loop, "_broadcast_sigterm_tensor", None)
    if loop is None or original is None:
        return False
    if getattr(original, "_lit_titan_amortised", False):
        return True

    def check() -> None:
        every = max(1, log_every(trainer))
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        first_micro_batch = loop.batch_progress.total.ready % accumulate == 0
        if first_micro_batch and (loop._batches_that_stepped + 1) % every == 0:
            original()

    check._lit_titan_amortised = True  # type: ignore[attr-defined]
    loop._broadcast_sigterm_tensor = check
    return True
