"""A progress bar in optimizer steps: ``step 37/100``, loss, tokens/s, elapsed and remaining time.

Why not Lightning's ``TQDMProgressBar`` as is: it counts batches of an epoch (``Epoch 0/-2``, and
under gradient accumulation several ticks per step), while a pre-training job is bounded and
resumed by optimizer steps (``trainer.max_steps``). This subclass keeps Lightning's tqdm bars,
rank-0-only drawing and validation bars, and moves the training bar once per optimizer step.

When stdout is not a terminal (CI logs, Slurm output files, notebooks), a bar redrawn with
carriage returns is unreadable; there it prints one plain line every ``refresh_rate`` steps and at
the last step: ``step 37/100 | loss 5.1234 | 3,110 tokens/s | elapsed 0:00:12 | remaining 0:00:21``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from lit_titan.strategies.contract import module_contract

__all__ = ["StepProgressBar"]


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps.

    ``refresh_rate``: optimizer steps between redraws (or plain lines). Each redraw reads the logged
    loss, so it should be a multiple of ``trainer.log_every_n_steps``: steps in between then read
    nothing back from the GPU. ``plain``: force (True) or forbid (False) the plain-line mode; by
    default it is on when stdout is not a terminal.
    """

    BAR_FORMAT = "step {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}{postfix}]"

    def __init__(self, refresh_rate: int = 1, plain: bool | None = None, file: Any = None) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._plain = plain
        self._file = file
        self._last_step = -1
        self._t0: float | None = None
        self._step0 = 0

    @property
    def plain(self) -> bool:
        if self._plain is not None:
            return self._plain
        isatty = getattr(sys.stdout, "isatty", None)
        return not (isatty and isatty())

    @property
    def is_disabled(self) -> bool:
        # Lightning builds every tqdm bar (sanity check, training, validation) with disable=is_disabled:
        # in plain mode none is drawn (their carriage returns would land in the log file).
        return super().is_disabled or self.plain

    def init_train_tqdm(self) -> Tqdm:
        bar = super().init_train_tqdm()
        bar.bar_format = self.BAR_FORMAT
        return bar

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._t0, self._step0 = time.perf_counter(), trainer.global_step
        self._last_step = trainer.global_step
        self._reset(trainer)  # Lightning skips on_train_epoch_start when it resumes mid-epoch

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self._reset(trainer)

    def _reset(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        # A resumed run starts where its checkpoint left off; tqdm's rate counts from `initial`.
        bar.initial = bar.n = trainer.global_step
        bar.refresh()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # a micro-batch of gradient accumulation: no optimizer step yet
            return
        self._last_step = step
        last = bool(trainer.max_steps) and step >= trainer.max_steps
        if not (self.is_enabled and (step % self.refresh_rate == 0 or last)):
            return
        loss = trainer.callback_metrics.get("train/loss")
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        done = step - self._step0
        tokens_per_s = done * module_contract(pl_module).tokens_per_step / elapsed if elapsed > 0 else 0.0
        if self.plain:
            print(
                self.plain_line(
                    step, trainer.max_steps, None if loss is None else float(loss), tokens_per_s, elapsed, done
                ),
                file=self._file or sys.stdout,
                flush=True,
            )
            return
        bar = self.train_progress_bar
        bar.n = step
        postfix = {"tokens/s": f"{tokens_per_s:,.0f}"}
        if loss is not None:
            postfix = {"loss": f"{float(loss):.4f}", **postfix}
        bar.set_postfix(postfix)  # refreshes the bar

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass  # the postfix set at the last step stays (the parent's would add every logged metric)

    @staticmethod
    def plain_line(
        step: int, max_steps: int | None, loss: float | None, tokens_per_s: float, elapsed: float, steps_done: int
    ) -> str:
        """``step 37/100 | loss 5.1234 | 3,110 tokens/s | elapsed 0:00:12 | remaining 0:00:21``."""
        parts = [f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        parts.append(f"{tokens_per_s:,.0f} tokens/s")
        parts.append(f"elapsed {timedelta(seconds=round(elapsed))}")
        if max_steps and max_steps > 0 and steps_done > 0:
            parts.append(f"remaining {timedelta(seconds=round(elapsed / steps_done * (max_steps - step)))}")
        return " | ".join(parts)
