"""Measures wall-clock throughput of a run and prints a short summary at the end (rank 0)."""

from __future__ import annotations

import time

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


class RunSummary(L.Callback):
    def __init__(self, run_dir: str | None = None) -> None:
        self.run_dir = run_dir
        self.summary: dict = {}
        self._t0: float | None = None
        self._steps0 = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Start the clock at the first batch: start-up (processes, data, model) is not throughput.
        if self._t0 is None:
            self._t0, self._steps0 = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        steps = trainer.global_step - self._steps0
        tokens_per_step = getattr(pl_module, "_tokens_per_step", 0)
        loss = trainer.callback_metrics.get("train/loss")
        self.summary = {
            "steps": trainer.global_step,
            "final_loss": float(loss) if loss is not None else None,
            "train_seconds": round(elapsed, 2),
            "tokens_per_second": round(steps * tokens_per_step / elapsed, 1) if elapsed > 0 else None,
            "run_dir": self.run_dir,
            # which launcher Lightning recognised (SLURMEnvironment under Slurm/submitit, TorchElastic, ...)
            "cluster_environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        }
        s = self.summary
        rank_zero_info(
            f"\nlit-titan: {s['steps']} steps, final train/loss {s['final_loss']:.4f}, "
            f"{s['tokens_per_second']} tokens/s over {s['train_seconds']} s\n"
            f"outputs in {self.run_dir} (metrics.csv, config.yaml, checkpoints/)"
            if s["final_loss"] is not None else f"\nlit-titan: done; outputs in {self.run_dir}"
        )
