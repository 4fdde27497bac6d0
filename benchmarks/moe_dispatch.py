"""One MoE layer (route + dispatch + grouped GEMM + combine) against a dense FFN of equal active FLOPs.

The MoE layer is lit-titan's own (``lit_titan/models/moe.py``: top-k routing with a stable sort, tokens
copied in expert order, one ``torch._grouped_mm`` per weight, weighted ``index_add_`` back); the dense FFN
is a SwiGLU of width ``top_k x hidden``, so both do the same expert matmul FLOPs per token. Timed
forward + backward (median over ``--steps`` after ``--warmup``), three ways:
  - ``moe``: the whole layer (router, dispatch, experts, combine);
  - ``experts``: the grouped GEMMs alone on tokens already in expert order (the same counts);
  - ``dense``: the SwiGLU of equal active FLOPs.
``moe - experts`` is what routing, dispatch and combine cost; ``experts / dense`` what grouping the
matmuls by expert costs against one big GEMM. Single device, no expert parallel (its all-to-all is the
planner's term, docs/planner.md).

Usage:
    python benchmarks/moe_dispatch.py                  # GPU: Qwen3-30B-A3B's layer, bf16, 16K tokens
    python benchmarks/moe_dispatch.py --cpu-smoke      # CPU, tiny shapes, fp32: plumbing only, seconds
    ... --tokens 8192 --dim 2048 --experts 128 --top-k 8 --hidden 768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from lit_titan.models.moe import MoE, MoEArgs, SwiGLU

GPU_DEFAULTS = dict(tokens=16384, dim=2048, experts=128, top_k=8, hidden=768, dtype="bfloat16")
CPU_SMOKE = dict(tokens=256, dim=64, experts=8, top_k=2, hidden=32, dtype="float32")


def _timed(fn, steps: int, warmup: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (forward + backward) over ``steps`` after ``warmup``."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(tokens: int, dim: int, experts: int, top_k: int, hidden: int, dtype: str, steps: int, warmup: int, device):
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    moe = MoE(dim, MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=hidden)).to(device)
    dense = SwiGLU(dim, top_k * hidden).to(device)
    for m in (moe, dense):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
    moe.to(dt), dense.to(dt)
    moe.train()
    x = torch.randn(1, tokens, dim, device=device, dtype=dt, requires_grad=True)
    # the same routing as the layer's, for the experts-only timing
    with torch.no_grad():
        _, _, idx = moe.router(x.view(-1, dim))
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=experts)
        order = torch.argsort(flat, stable=True)
    sorted_x = x.detach().view(-1, dim)[order // top_k].clone().requires_grad_(True)

    def step_moe():
        moe(x).float().square().mean().backward()

    def step_experts():
        moe.experts(sorted_x, counts).float().square().mean().backward()

    def step_dense():
        dense(x).float().square().mean().backward()

    secs = {
        name: _timed(fn, steps, warmup, device)
        for name, fn in (("moe", step_moe), ("experts", step_experts), ("dense", step_dense))
    }
    flops = 6 * tokens * top_k * 3 * dim * hidden  # forward + backward expert matmuls (= the dense FFN's)
    load = counts.float()
    return {
        "tokens": tokens,
        "dim": dim,
        "experts": experts,
        "top_k": top_k,
        "hidden": hidden,
        "dtype": dtype,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "grouped_gemm": moe.experts.use_grouped(sorted_x),
        "ms": {k: v * 1e3 for k, v in secs.items()},
        "tflops": {k: flops / v / 1e12 for k, v in secs.items()},
        "dispatch_combine_ms": (secs["moe"] - secs["experts"]) * 1e3,
        "moe_over_dense": secs["moe"] / secs["dense"],
        "load_max_mean": float(load.max() / load.mean()),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU in fp32 (plumbing only)")
    for key in ("tokens", "dim", "experts", "top-k", "hidden"):
        ap.add_argument(f"--{key}", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    if not a.cpu_smoke and not torch.cuda.is_available():
        print(
            "moe_dispatch: error: --cpu-smoke=false: no CUDA device; run on a GPU or pass --cpu-smoke", file=sys.stderr
        )
        raise SystemExit(2)
    shape = dict(CPU_SMOKE if a.cpu_smoke else GPU_DEFAULTS)
    for key in ("tokens", "dim", "experts", "top_k", "hidden", "dtype"):
        if getattr(a, key) is not None:
            shape[key] = getattr(a, key)
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    steps = a.steps or (3 if a.cpu_smoke else 20)
    warmup = a.warmup if a.warmup is not None else (1 if a.cpu_smoke else 5)
    threads = torch.get_num_threads()
    if a.cpu_smoke:
        torch.set_num_threads(1)  # tiny matmuls: more threads only contend on a shared CPU
    try:
        r = run(**shape, steps=steps, warmup=warmup, device=device)
    finally:
        torch.set_num_threads(threads)
    label = " (CPU smoke: plumbing only, not a performance figure)" if a.cpu_smoke else ""
    print(
        f"moe_dispatch on {r['device']}{label}: {r['tokens']} tokens, dim {r['dim']}, {r['experts']} experts, "
        f"top {r['top_k']}, expert width {r['hidden']}, {r['dtype']}, grouped GEMM {r['grouped_gemm']}, "
        f"load max/mean {r['load_max_mean']:.2f}"
    )
    print("| path | ms fwd+bwd | expert TFLOP/s |")
    print("|---|---:|---:|")
    for k in ("moe", "experts", "dense"):
        print(f"| {k} | {r['ms'][k]:.3f} | {r['tflops'][k]:.3g} |")
    print(f"route + dispatch + combine: {r['dispatch_combine_ms']:.3f} ms; MoE / dense: {r['moe_over_dense']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
