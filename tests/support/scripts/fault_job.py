"""A training job with injected faults, for the failure-observability tests.

Usage: fault_job.py MODE [hydra overrides]
  hang:     rank 1 stops forever at the start of optimizer step 2 (in ``hang_here_forever``);
            the other rank blocks in the step's first collective.
  straggle: rank 1 sleeps ``SLOW_S`` before every batch; at optimizer step ``POISON_STEP`` rank 1
            writes a NaN into its local gradient shard, and every rank records whether that
            step's update left its parameters and optimizer state untouched
            (``<run_dir>/skipcheck-rank<R>.json``).
Run as a script: Lightning's launcher re-runs it (same argv) for the other ranks.
"""

import json
import os
import sys
import time

import lightning as L
import torch

from lit_titan.config import compose
from lit_titan.job.run import train

SLOW_S = 0.5
POISON_STEP = 5


def hang_here_forever() -> None:
    while True:
        time.sleep(1)


class HangAt(L.Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            hang_here_forever()


class SlowRank(L.Callback):
    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class PoisonGrad(L.Callback):
    """One NaN in one rank's local gradient shard: only that rank sees it locally."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            grad = _local(pl_module.model.tok_embeddings.weight.grad)
            grad.view(-1)[0] = float("nan")


class CheckSkip(L.Callback):
    """Did the poisoned step leave parameters and optimizer state untouched, and did a normal step not?"""

    def __init__(self, step: int, out_dir: str) -> None:
        self.step, self.out_dir, self.result = step, out_dir, {}
        self._before = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step in (self.step - 1, self.step):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._before = (
                trainer.global_step,
                [_local(p.detach()).clone() for p in params],
                [float(optimizer.state[p].get("step", 0)) for p in params],
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._before is None or trainer.global_step != self._before[0] + 1:
            return
        step, params_before, steps_before = self._before
        optimizer = trainer.optimizers[0]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        same = all(torch.equal(_local(p.detach()), b) for p, b in zip(params, params_before))
        state_same = steps_before == [float(optimizer.state[p].get("step", 0)) for p in params]
        self.result[str(step)] = {"params_unchanged": same, "optimizer_state_unchanged": state_same}
        self._before = None
        with open(os.path.join(self.out_dir, f"skipcheck-rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.result, f)


def main() -> None:
    mode, overrides = sys.argv[1], sys.argv[2:]
    cfg = compose(overrides)
    if mode == "hang":
        callbacks = [HangAt(rank=1, step=2)]
    elif mode == "straggle":
        run_dir = os.environ.get("LIT_TITAN_RUN_DIR") or str(cfg.run_dir)
        callbacks = [
            SlowRank(rank=1, seconds=SLOW_S),
            PoisonGrad(rank=1, step=POISON_STEP),
            CheckSkip(step=POISON_STEP, out_dir=run_dir),
        ]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    train(cfg, callbacks=callbacks)


if __name__ == "__main__":
    main()
