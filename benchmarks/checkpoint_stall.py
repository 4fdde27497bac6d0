"""How long a checkpoint save blocks training, against the floor: one copy of the rank's state.

One training run through the real entry point's ``train()`` (in this process, one rank), saving
every ``--every`` steps. At each save step a probe callback (it runs before ``Checkpointing``):
1. waits for the previous save to be written, so a save is never charged for its predecessor's
   write (reported as "waited");
2. times one copy of the rank's checkpointed state (the tensors ``trainer.save_checkpoint`` hands
   to the writer) into buffers it allocated beforehand (pinned on CUDA, ``non_blocking`` + one
   sync): the cost no staging can go below. Median of 3;
then ``Checkpointing`` saves, and the writer records the time the loop was blocked (the whole
``trainer.save_checkpoint``: state dicts, free-space check, small files, staging) and the time
until the checkpoint was complete on disk (written by every rank and published).

    python benchmarks/checkpoint_stall.py                 # 8B widths, 4 layers, one GPU (docs/benchmarks.md)
    python benchmarks/checkpoint_stall.py --cpu-smoke     # a 0.8 GB state on CPU (what the test runs)
    python benchmarks/checkpoint_stall.py --saves 4 --every 5 -- model.n_layers=2   # extra overrides

The first save allocates the staging buffers (reported separately); the claim is about later ones:
blocked <= 1.5 x one copy, fastest against fastest (tests/unit/checkpoint/test_gpu_path_checkpoint.py) and, on one H100 with a 23 GB state,
<= 1 s (a save then costs less than a few steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

GPU_JOB = [
    "model=llama3_8b",
    "model.n_layers=4",
    "cluster=gpu_1",
    "precision=bf16-mixed",
    "data.seq_len=8192",
    "data.global_batch_size=1",
    "data.tokenizer.vocab_size=32000",
    "callbacks=[]",
]
# A 67M-parameter model whose state (0.8 GB with AdamW) is mostly embedding and output tables, so
# that a step stays cheap on 2 CPU cores while one copy of the state (~0.1 s) dwarfs the fixed
# costs of a save (~0.02 s: Lightning's state dicts and barrier, small files, thread start).
CPU_JOB = [
    "model=llama3_debug",
    "model.dim=256",
    "model.n_layers=1",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=131072",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.tokenizer.vocab_size=512",
    "data.global_batch_size=2",
    "cluster=cpu",
    "cluster.devices=1",
    "precision=32-true",
    "callbacks=[]",
]


class StallProbe(L.Callback):
    """Before each save: wait for the previous one, then time one copy of the rank's state."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.one_copy_s: dict[int, float] = {}
        self.copied_bytes = 0
        self.waited_s: dict[int, float] = {}
        self.step_s: list[float] = []
        self._buffers: list[torch.Tensor] | None = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        self.step_s.append(time.perf_counter() - self._t0)  # the step itself, before any save (written meanwhile)
        if step % self.every and step < trainer.max_steps:
            return
        writer = trainer.strategy.checkpoint_writer
        start = time.perf_counter()
        writer.wait()
        self.waited_s[step] = time.perf_counter() - start
        self.one_copy_s[step] = self._one_copy(trainer)

    def _one_copy(self, trainer: L.Trainer) -> float:
        from lit_titan.checkpoint.staging import local_tensors

        strategy = trainer.strategy
        state = [strategy.lightning_module_state_dict(), *(strategy.optimizer_state(o) for o in trainer.optimizers)]
        sources = [t for _, t in local_tensors(state)]
        self.copied_bytes = sum(t.numel() * t.element_size() for t in sources)
        if self._buffers is None or [b.shape for b in self._buffers] != [t.shape for t in sources]:
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in sources]
            for b in self._buffers:
                b.fill_(0)  # fault the pages in: this buffer is "allocated beforehand"
        times = []
        for _ in range(3):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                for buf, src in zip(self._buffers, sources):
                    buf.copy_(src, non_blocking=src.is_cuda)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def run(overrides: list[str], saves: int, every: int, run_dir: Path) -> dict[str, Any]:
    from lit_titan.config import compose
    from lit_titan.job.run import train

    steps = saves * every
    cfg = compose(
        [
            *overrides,
            f"trainer.max_steps={steps}",
            f"checkpoint.every_n_steps={every}",
            "checkpoint.keep_last=2",
            "trainer.enable_progress_bar=false",
            f"run_dir={run_dir}",
        ]
    )
    probe = StallProbe(every)
    captured: dict[str, Any] = {}

    class Capture(L.Callback):
        def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
            captured["writer"] = trainer.strategy.checkpoint_writer

    train(cfg, callbacks=[probe, Capture()])
    rows = []
    for i, rec in enumerate(captured["writer"].records):
        step = int(rec.name.split("-")[1])
        one = probe.one_copy_s.get(step)
        rows.append(
            {
                "save": i + 1,
                "step": step,
                "state_bytes": rec.local_bytes,
                "allocated_bytes": rec.allocated_bytes,
                "waited_s": probe.waited_s.get(step),
                "blocked_s": rec.blocked_s,
                "one_copy_s": one,
                "ratio": rec.blocked_s / one if one and rec.blocked_s is not None else None,
                "stage_s": rec.stage_s,
                "writer_s": rec.save_s,
                "prepare_s": rec.prepare_s,
                "complete_s": rec.complete_s,
            }
        )
    return {
        "rows": rows,
        "one_copy_bytes": probe.copied_bytes,
        "median_step_s": statistics.median(probe.step_s) if probe.step_s else None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "cpus": os.cpu_count(),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| save | step | state (rank) | allocated | training blocked | one copy | blocked / copy | staging copy "
        "| complete on disk |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['save']}{' (first)' if r['save'] == 1 else ''} | {r['step']} | "
            f"{r['state_bytes'] / 1e9:.3f} GB | {r['allocated_bytes'] / 1e9:.3f} GB | {r['blocked_s']:.3f} s | "
            f"{r['one_copy_s']:.3f} s | {r['ratio']:.2f} | {r['stage_s']:.3f} s | "
            f"{r['complete_s']:.3f} s |"
        )
    later = [r["ratio"] for r in result["rows"][1:]]
    step = result["median_step_s"]
    lines.append(
        f"\n{result['device']}, torch {result['torch']}, {result['cpus']} CPUs, {result['date']}; median "
        f"training step (the save not included) {step:.3f} s; later saves: blocked / one copy = "
        + (f"{min(later):.2f}-{max(later):.2f}" if later else "n/a")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="a 0.8 GB state on CPU (tests run this)")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=None, help="steps between saves (default: 3 CPU, 20 GPU)")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the job")
    args = parser.parse_args(argv)
    base = CPU_JOB if args.cpu_smoke else GPU_JOB
    every = args.every or (3 if args.cpu_smoke else 20)
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as tmp:
        result = run([*base, *args.overrides], args.saves, every, args.run_dir or Path(tmp))
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
