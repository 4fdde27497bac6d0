"""Running the real command line in subprocesses and reading what a run wrote."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

# A model small enough that an 8-process run takes seconds on 2 cores.
TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512",
    "data.seq_len=32", "data.max_bytes=300000", "data.global_batch_size=8",
    "trainer.enable_progress_bar=false", "optim.warmup_steps=2",
]


def run_cli(overrides: list[str], run_dir: Path, *, check: bool = True, timeout: int = 600,
            module: str = "lit_titan.train") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LIT_TITAN_RUN_DIR", "LOCAL_RANK", "RANK")}
    cmd = [sys.executable, "-m", module, *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(Path(run_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def losses(run_dir: Path) -> list[float]:
    return [float(r["train/loss"]) for r in read_metrics(run_dir) if r.get("train/loss")]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """Model weights of the run's last checkpoint (a DCP directory), gathered into full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(run_dir) / "final_params.pt"
    dcp_to_torch_save(Path(run_dir) / "checkpoints" / "last.ckpt", out)
    return torch.load(out, weights_only=True)["state_dict"]


def assert_losses_match(got: list[float], ref: list[float], rtol: float) -> None:
    assert len(got) == len(ref) and len(ref) > 0, (len(got), len(ref))
    worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    assert worst <= rtol, f"worst relative loss difference {worst:.3g} > {rtol}\n got={got}\n ref={ref}"
