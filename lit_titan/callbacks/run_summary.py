"""Measures wall-clock throughput of a run and prints, at the end (rank 0), what to look at next.

The last lines of a run are what a user reads: its figures (steps, tokens, tokens/s, final loss, MFU
where the GPU's peak is known), where the metrics are and the command that shows them, and the
command that trains this run further from its last checkpoint.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_titan.observe.redact import MASK
from lit_titan.strategies.contract import contract, module_contract

__all__ = ["RunSummary", "SUMMARY_FILE"]

SUMMARY_FILE = "summary.json"  # the run's figures (parameters, layout, steps, tokens, wall time), written at its end


class RunSummary(L.Callback):
    """Collects the run summary (``self.summary``, returned by ``lit_titan.train.main``) and prints it.

    ``continue_command``: the command line that resumes this run with more steps (built by the entry
    point, which knows the user's overrides; shell-quoted, credentials as ``***``); ``tensorboard_dir``: set when a TensorBoard logger is on;
    ``checkpoint_dir``: where the run saves checkpoints (None: it saves none).

    The outputs named are those the run has written, or writes after this callback's ``on_train_end``
    (the final checkpoint, the CSV logger's last flush): never a directory that will not be there.
    """

    def __init__(
        self,
        run_dir: str | None = None,
        continue_command: str | None = None,
        tensorboard_dir: str | None = None,
        checkpoint_dir: str | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.continue_command = continue_command
        self.tensorboard_dir = tensorboard_dir
        self.checkpoint_dir = checkpoint_dir
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
        module = module_contract(pl_module)
        tokens_per_step = module.tokens_per_step
        loss = trainer.callback_metrics.get("train/loss")
        mfu = trainer.callback_metrics.get("perf/mfu")
        from lit_titan.models.registry import count_params

        args = module.model_args
        dims = contract(trainer.strategy).parallel_dims
        self.summary = {
            "parameters": count_params(args) if args is not None else None,
            "layout": {k: getattr(dims, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")} if dims else None,
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "tokens": trainer.global_step * tokens_per_step,
            "final_loss": float(loss) if loss is not None else None,
            "train_seconds": round(elapsed, 2),
            "tokens_per_second": round(steps * tokens_per_step / elapsed, 1) if elapsed > 0 else None,
            "mfu": float(mfu) if mfu is not None else None,
            "run_dir": self.run_dir,
            # which launcher Lightning recognised (SLURMEnvironment under Slurm/submitit, TorchElastic, ...)
            "cluster_environment": type(contract(trainer.strategy).cluster_environment).__name__,
            "continue_command": self.continue_command,
        }
        if trainer.is_global_zero and self.run_dir:  # what `lit-titan report` shows beside the curves
            (Path(self.run_dir) / SUMMARY_FILE).write_text(json.dumps(self.summary, indent=1) + "\n")
        rank_zero_info("\n" + "\n".join(self.lines()))

    def lines(self) -> list[str]:
        """The end-of-run lines, each prefixed ``lit-titan:`` (so logs and notebooks can pick them out)."""
        s = self.summary
        if s.get("final_loss") is None:
            return [f"lit-titan: done; outputs in {self.run_dir}"]
        figures = (
            f"{s['steps']} steps, {s['tokens']:,} tokens, final train/loss {s['final_loss']:.4f}, "
            f"{s['tokens_per_second'] or 0:,} tokens/s over {s['train_seconds']} s"
        )
        if s.get("mfu") is not None:
            figures += f", MFU {100 * s['mfu']:.1f}%"
        out = [
            f"lit-titan: {figures}",
            f"lit-titan: outputs in {self.run_dir} ({', '.join(self.outputs())})",
            f"lit-titan: see the metrics: {shlex.join(['lit-titan', 'report', str(self.run_dir)])}  "
            f"(writes report.html there)",
        ]
        if self.tensorboard_dir and Path(self.tensorboard_dir).is_dir():
            out.append(f"lit-titan: TensorBoard: {shlex.join(['tensorboard', '--logdir', str(self.tensorboard_dir)])}")
        if self.continue_command:
            more = f"{s['steps']} more step" + ("s" if s["steps"] != 1 else "")
            out.append(f"lit-titan: train {more} from the last checkpoint: {self.continue_command}")
            if MASK in self.continue_command:
                out.append(
                    f"lit-titan: credentials are shown as {MASK} (never printed or written): put them back, or "
                    "drop them and set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (W&B: "
                    "WANDB_API_KEY) in the environment (docs/data.md)"
                )
        return out

    def outputs(self) -> list[str]:
        """The run directory's outputs, as named on the summary line."""
        run = Path(self.run_dir or ".")
        names = [
            "metrics.csv"
        ]  # the CSV logger every run has (train.build_loggers) writes it at the latest on teardown
        names += ["config.yaml"] if (run / "config.yaml").is_file() else []
        names += [f"{Path(self.checkpoint_dir).name}/"] if self.checkpoint_dir else []  # the last is saved after us
        tb = Path(self.tensorboard_dir) if self.tensorboard_dir else None
        names += [f"{tb.name}/"] if tb is not None and tb.parent == run and tb.is_dir() else []
        return names
