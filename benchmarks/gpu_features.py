"""The single-GPU table: what each performance feature buys on a Llama 3.1 8B-shaped model.

Each configuration is one training run through the real entry point (``python -m lit_titan.train``,
``cluster=gpu_1``), in its own process (fresh CUDA memory statistics and compile caches), for
``--warmup + --steps`` optimizer steps; the table reports the mean of the ``perf/*`` metrics that
``ThroughputMonitor`` logged over the last ``--steps`` steps, and the run's peak memory.

    python benchmarks/gpu_features.py --layers 8 --seq-len 8192 --steps 10 --warmup 5 > table.md
    python benchmarks/gpu_features.py --only bf16_eager bf16_compile          # a subset
    python benchmarks/gpu_features.py --cpu-smoke                              # checks the plumbing on CPU

8B widths (dim 4096, 32 heads, 8 kv heads, FFN 14336, vocab 128256) with ``--layers`` blocks: pick
as many as fit with AdamW state on the GPU (``lit-titan plan model=llama3_8b
model.n_layers=N cluster=gpu_1 data.seq_len=8192`` estimates it). Only run on a real GPU for numbers
that go into docs/benchmarks.md; ``--cpu-smoke`` numbers mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> extra overrides (all on top of bf16-mixed, micro-batch 1, seq --seq-len)
CONFIGS: dict[str, list[str]] = {
    "bf16_eager": ["callbacks=[throughput]"],
    "bf16_compile": ["callbacks=[throughput,compile]"],
    "compile_ac_full": [
        "callbacks=[throughput,compile,activation_checkpointing]",
        "callbacks.activation_checkpointing.mode=full",
    ],
    "compile_ac_selective_op": [
        "callbacks=[throughput,compile,activation_checkpointing]",
        "callbacks.activation_checkpointing.mode=selective_op",
    ],
    "compile_float8_tensorwise": ["callbacks=[throughput,compile,float8]", "callbacks.float8.recipe=tensorwise"],
    "compile_float8_rowwise": ["callbacks=[throughput,compile,float8]", "callbacks.float8.recipe=rowwise"],
    "compile_float8_rowwise_gw_hp": [
        "callbacks=[throughput,compile,float8]",
        "callbacks.float8.recipe=rowwise_with_gw_hp",
    ],
}
# --cpu-smoke: a model small enough that start-up dominates (shared with vs_bare_loop.py's bare loop)
SMOKE_MODEL = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
SMOKE_SEQ_LEN = 64
METRICS = (
    "perf/tokens_per_sec_per_device",
    "perf/tflops_per_device",
    "perf/mfu",
    "perf/max_memory_allocated_gib",
    "perf/max_memory_reserved_gib",
)


def run_config(name: str, extra: list[str], args: argparse.Namespace, root: Path) -> dict[str, float | str]:
    run_dir = root / name
    cmd = [sys.executable, "-m", "lit_titan.train", *lit_overrides(extra, args, run_dir)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200], "wall_s": wall}
    return {**read_result(name, run_dir, args), "wall_s": wall}


def lit_overrides(
    extra: list[str], args: argparse.Namespace, run_dir: Path, smoke_model: dict[str, int] = SMOKE_MODEL
) -> list[str]:
    """The ``python -m lit_titan.train`` overrides of one configuration (``extra`` on top of the shapes)."""
    if args.cpu_smoke:
        base = [
            "model=llama3_debug",
            *[f"model.{k}={v}" for k, v in smoke_model.items()],
            "cluster=cpu",
            "precision=32-true",
            f"data.seq_len={SMOKE_SEQ_LEN}",
            "data.max_bytes=300000",
            "data.tokenizer.vocab_size=512",
        ]
        extra = [_without(e, ("compile",)) for e in extra]
        if any("float8" in e for e in extra):  # no FP8 units: emulate, and keep the tiny Linears
            extra += ["callbacks.float8.emulate=true", "callbacks.float8.auto_filter_small_kn=false"]
    else:
        base = [
            "model=llama3_8b",
            f"model.n_layers={args.layers}",
            "cluster=gpu_1",
            "precision=bf16-mixed",
            f"data.seq_len={args.seq_len}",
            f"data.tokenizer.vocab_size={args.tokenizer_vocab}",
        ]
    return [
        *base,
        *extra,
        "data.global_batch_size=1",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.enable_progress_bar=false",
        "checkpoint.enabled=false",
        "callbacks.throughput.warmup_steps=1",
        f"run_dir={run_dir}",
    ]


def read_result(name: str, run_dir: Path, args: argparse.Namespace) -> dict[str, float | str]:
    """Mean ``perf/*`` over the steps after ``--warmup`` (peak for memory) from the run's metrics.csv."""
    rows = [r for r in csv.DictReader(open(run_dir / "metrics.csv")) if r.get("step")]
    rows = [r for r in rows if int(r["step"]) >= args.warmup]
    out: dict[str, float | str] = {"name": name}
    for key in METRICS:
        values = [float(r[key]) for r in rows if r.get(key)]
        if values:
            out[key] = max(values) if "memory" in key else sum(values) / len(values)
    return out


def _without(override: str, callbacks: tuple[str, ...]) -> str:
    """``callbacks=[a,b,c]`` minus ``callbacks`` (CPU smoke: no inductor, no FP8 units)."""
    if not override.startswith("callbacks=["):
        return override
    kept = [c for c in override[len("callbacks=[") : -1].split(",") if c not in callbacks]
    return f"callbacks=[{','.join(kept)}]"


def table(results: list[dict], baseline: str = "bf16_eager") -> str:
    base = next((r.get("perf/tokens_per_sec_per_device") for r in results if r["name"] == baseline), None)
    lines = [
        "| config | tokens/s/GPU | vs bf16 eager | TFLOP/s/GPU | MFU (vs bf16 dense peak) | max alloc GiB | "
        "max reserved GiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | |")
            continue
        tps = r.get("perf/tokens_per_sec_per_device")
        ratio = f"{tps / base:.2f}x" if tps and base else ""
        fmt = lambda k, f, r=r: f.format(r[k]) if k in r else "n/a"  # noqa: E731
        lines.append(
            f"| {r['name']} | {fmt('perf/tokens_per_sec_per_device', '{:.0f}')} | {ratio} | "
            f"{fmt('perf/tflops_per_device', '{:.1f}')} | {fmt('perf/mfu', '{:.1%}')} | "
            f"{fmt('perf/max_memory_allocated_gib', '{:.1f}')} | "
            f"{fmt('perf/max_memory_reserved_gib', '{:.1f}')} |"
        )
    return "\n".join(lines)


def environment() -> str:
    import torch

    versions = {"torch": torch.__version__}
    for pkg in ("lightning", "torchao"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except ImportError:
            versions[pkg] = "missing"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return (
        f"device: {device}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; date: {time.strftime('%Y-%m-%d')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring (compile, allocator)")
    parser.add_argument(
        "--tokenizer-vocab",
        type=int,
        default=32000,
        help="BPE trained on the embedded corpus; the model keeps Llama 3.1's 128256 rows",
    )
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the script only")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_config(n, CONFIGS[n], args, Path(tmp)) for n in names]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"Command: python benchmarks/gpu_features.py {' '.join(sys.argv[1:])}")
    print(environment())
    model = (
        f"CPU smoke test: llama3_debug with {SMOKE_MODEL}, seq {SMOKE_SEQ_LEN}, fp32, no compile, Float8 emulated "
        "(numbers mean nothing)"
        if args.cpu_smoke
        else f"Llama 3.1 8B widths, {args.layers} layers, seq {args.seq_len}, micro-batch 1, bf16-mixed, AdamW"
    )
    print(f"Model: {model}; mean over {args.steps} steps after {args.warmup} warm-up steps\n")
    print(table(results))


if __name__ == "__main__":
    main()
