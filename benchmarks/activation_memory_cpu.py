"""The planner's per-rank activation estimate against memory measured on CPU.

For each layout, one process plays rank 0 of a ``fake`` process group (torch's backend whose
collectives return without moving data: the process holds exactly rank 0's tensors, at their real
shapes), builds the model through ``TitanStrategy.parallelize`` (the training code path: TP, CP,
activation checkpointing, the pipeline split), runs forward and backward of one step's
micro-batches, and reads the peak from torch's ``MemTracker`` (``torch.distributed._tools``: it
tracks every tensor storage by category on any device; torch has no public CPU allocator
statistics). Measured = activations + temporaries at the peak, i.e. everything but parameters,
buffers and parameter gradients; the estimate is the plan's ``activation_bytes`` for the same
overrides (``lit-titan plan``). Values are garbage (fake collectives), sizes are real.

Under pipeline parallelism rank 0 is the first stage: 1F1B's warmup runs min(pp, micro-batches)
forwards before the first backward, so the probe runs that many micro-batches in one forward (the
same activation bytes: they grow linearly in rows), then its backward.

    python benchmarks/activation_memory_cpu.py            # the table in docs/benchmarks.md
    python benchmarks/activation_memory_cpu.py --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any

import torch

MODEL = [
    "model.dim=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=2048",
    "data.seq_len=256",
    "data.global_batch_size=2",
    "precision=32-true",
    "callbacks=[]",
]
AC = "+callbacks.activation_checkpointing._target_=lit_titan.callbacks.ActivationCheckpointing"
LAYOUTS: dict[str, list[str]] = {
    "AC none": [],
    "AC selective_op": [AC, "+callbacks.activation_checkpointing.mode=selective_op"],
    "AC full": [AC, "+callbacks.activation_checkpointing.mode=full"],
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "tp2, AC full": ["cluster.devices=2", "parallel.tp=2", AC, "+callbacks.activation_checkpointing.mode=full"],
    "cp2": ["cluster.devices=2", "parallel.cp=2"],
    "pp2 (1F1B, 2 micro-batches)": ["cluster.devices=2", "parallel.pp=2", "parallel.pp_microbatches=2"],
}
# Not measured: pipeline stages with activation checkpointing. The probe runs the in-flight
# micro-batches as one forward (MemTracker refuses a second forward of a module before its
# backward), so a recomputed block would span all of them instead of one micro-batch.
TOLERANCE = 0.15  # the estimate within 15% of the measurement: close enough to choose a layout by


def measure(overrides: list[str]) -> dict[str, Any]:
    """Rank 0's peak activation + temporary bytes for one step of the layout ``overrides``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from lit_titan.config import compose
    from lit_titan.config.spec import model_args, parallel_dims
    from lit_titan.job.build import build_strategy
    from lit_titan.models.llama3 import Transformer
    from lit_titan.planner.build import fake_process_group, request_transforms
    from lit_titan.planner.core import _instantiate_callbacks

    cfg = compose(overrides)
    args, dims = model_args(cfg), parallel_dims(cfg)
    strategy = build_strategy(cfg)
    with fake_process_group(dims.world_size):
        strategy.init_layout(dims, "cpu")
        request_transforms(strategy, _instantiate_callbacks(cfg, []))
        with torch.device("meta"):
            model = Transformer(args)
        model, _ = strategy.parallelize(model, str(cfg.precision))
        model.to_empty(device="cpu")
        model.init_weights(seed=0, buffer_device=torch.device("cpu"))
        seq, batch = int(cfg.data.seq_len), int(cfg.data.global_batch_size) // dims.dp
        micro = dims.pp and (strategy.pipeline_config.microbatches_for(dims.pp) if dims.pp > 1 else 1)
        in_flight = min(dims.pp, micro) if dims.pp > 1 else 1
        tokens = torch.randint(
            0, args.vocab_size, (batch // micro, seq + 1), generator=torch.Generator().manual_seed(0)
        )
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if strategy.context_parallel is not None:
            inputs, labels = strategy.context_parallel.shard(inputs, labels)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, strategy._loss_context():
            if dims.pp > 1:  # the first stage: embedding and blocks, no head
                # in_flight micro-batches at once: MemTracker refuses a module's second forward before
                # its backward, and activations (SDPA keeps no s x s scores) grow linearly in rows.
                out = model(inputs.repeat(in_flight, 1))
                out.backward(torch.ones_like(out))
            else:
                model(inputs, labels=labels).backward()
        peak = _activation_peak(tracker)
    return {
        "measured_bytes": peak["ACT"] + peak["TEMP"],
        "act_bytes": peak["ACT"],
        "temp_bytes": peak["TEMP"],
        "in_flight_microbatches": in_flight,
    }


def _activation_peak(tracker) -> dict[str, int]:
    """The largest ACT + TEMP over every module's forward and backward peak.

    Not ``get_tracker_snapshot("peak")``: that is the moment of the largest *total*, which comes
    late in backward when the parameter gradients exist and most activations are gone.
    """
    best = {"ACT": 0, "TEMP": 0}
    for stats in tracker.memory_tracking.values():
        for state, snaps in stats.snapshots.items():
            if "PEAK" not in str(state):
                continue
            for snap in snaps:
                cats = {str(k).rsplit(".", 1)[-1]: v for k, v in snap.get(torch.device("cpu"), {}).items()}
                cur = {"ACT": cats.get("ACT", 0), "TEMP": cats.get("TEMP", 0)}
                if cur["ACT"] + cur["TEMP"] > best["ACT"] + best["TEMP"]:
                    best = cur
    return best


def estimate(overrides: list[str]) -> dict[str, Any]:
    from lit_titan.cli.plan import make_plan

    return make_plan(overrides, write=False)["per_rank"]["activation_detail"]


def run(layouts: dict[str, list[str]]) -> list[dict[str, Any]]:
    rows = []
    for name, extra in layouts.items():
        overrides = [*MODEL, *extra]
        got, est = measure(overrides), estimate(overrides)
        rows.append(
            {
                "layout": name,
                "overrides": extra,
                **got,
                "estimate_bytes": est["total"],
                "estimate": est,
                "error": est["total"] / got["measured_bytes"] - 1,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| layout | measured (act + temp) | estimate | error |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['measured_bytes'] / 2**20:.1f} MiB ({r['act_bytes'] / 2**20:.1f} + "
            f"{r['temp_bytes'] / 2**20:.1f}) | {r['estimate_bytes'] / 2**20:.1f} MiB | {r['error']:+.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    ns = parser.parse_args(argv)
    layouts = {k: v for k, v in LAYOUTS.items() if not ns.only or k in ns.only}
    rows = run(layouts)
    print(table(rows))
    print(
        f"\ncpu, torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.python_version()}, "
        f"{datetime.date.today()}; model: {' '.join(MODEL)}; tolerance {TOLERANCE:.0%}"
    )
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump({"rows": rows, "tolerance": TOLERANCE}, fh, indent=1)
    return 0 if all(abs(r["error"]) <= TOLERANCE for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
