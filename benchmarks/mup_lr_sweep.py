"""Learning-rate sweep at three widths, with and without muP: does the best lr stay put as the model widens?

The tiny Llama of ``mup_coord_check.py`` (2 layers, 4 heads, byte vocabulary, the standard library's
source) at each width, trained for ``--steps`` steps from the same seed on the same batches (fresh
text every step, so the training loss is a held-out loss) at each lr of a grid in powers of 2 (lr
warmed up over the first 10% of steps, then cosine to 10%). Score: the mean loss of the last 10
steps; a run that diverges scores inf. One process, CPU, one thread. muP's base width is the smallest
width, so the two parametrisations coincide there.

    python benchmarks/mup_lr_sweep.py                   # writes mup_lr_sweep.{json,png}, prints the table
    python benchmarks/mup_lr_sweep.py --optim muon --lrs -9 -2
    python benchmarks/mup_lr_sweep.py --smoke           # seconds: two widths, two lrs, three steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from pathlib import Path

import torch
from mup_coord_check import BASE_WIDTH, WIDTHS, batches, text_bytes, tiny_args, train

LAST = 10  # steps averaged for the score


def sweep(
    widths: tuple[int, ...], log2_lrs: list[int], optim: str, steps: int, batch: int, seq: int
) -> dict[str, dict[int, dict[int, float]]]:
    """{"SP"|"muP": {width: {log2(lr): score}}}."""
    data = batches(text_bytes(4_000_000), steps, batch=batch, seq=seq)
    out: dict[str, dict[int, dict[int, float]]] = {}
    for label, mup in (("SP", False), ("muP", True)):
        for width in widths:
            for e in log2_lrs:
                start = time.perf_counter()
                losses, _ = train(tiny_args(width, mup, seq=seq), optim, 2.0**e, data, warmup=max(steps // 10, 1))
                tail = losses[-min(LAST, len(losses)) :]
                score = sum(tail) / len(tail) if len(losses) == steps and all(map(math.isfinite, tail)) else math.inf
                out.setdefault(label, {}).setdefault(width, {})[e] = score
                print(f"{label} width {width} lr 2^{e}: {score:.4f} ({time.perf_counter() - start:.1f} s)", flush=True)
    return out


def optimum(scores: dict[int, float]) -> int:
    """log2 of the best lr."""
    return min(scores, key=lambda e: scores[e])


def plot(results: dict[str, dict[int, dict[int, float]]], optim: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), sharey=True, squeeze=False)
    for ax, (label, by_width) in zip(axes[0], results.items()):
        for width, scores in by_width.items():
            es = sorted(scores)
            (line,) = ax.plot([2.0**e for e in es], [scores[e] for e in es], marker="o", label=f"width {width}")
            best = optimum(scores)
            ax.plot([2.0**best], [scores[best]], marker="*", markersize=14, color=line.get_color())
        ax.set(xscale="log", xlabel="lr", title=f"{label}, optim={optim}")
        ax.legend()
    finite = [s for by_width in results.values() for sc in by_width.values() for s in sc.values() if math.isfinite(s)]
    axes[0][0].set(ylabel=f"loss (mean of the last {LAST} steps)", ylim=(min(finite) - 0.05, min(max(finite), 4.0)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--optim", default="adamw", choices=("adamw", "muon"))
    p.add_argument("--lrs", type=int, nargs=2, default=[-11, -4], help="log2 of the smallest and the largest lr")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--out", default="mup_lr_sweep", help="path stem of the .json and .png written")
    p.add_argument("--smoke", action="store_true", help="two widths, two lrs, three steps: the plumbing only")
    ns = p.parse_args(argv)
    if ns.smoke:
        ns.widths, ns.lrs, ns.steps = [BASE_WIDTH, 2 * BASE_WIDTH], [-8, -7], 3
    torch.set_num_threads(1)  # tiny Python-bound steps
    start = time.perf_counter()
    results = sweep(tuple(ns.widths), list(range(ns.lrs[0], ns.lrs[1] + 1)), ns.optim, ns.steps, ns.batch, ns.seq)
    best = {label: {w: optimum(s) for w, s in by_width.items()} for label, by_width in results.items()}
    record = {
        "optim": ns.optim,
        "steps": ns.steps,
        "tokens_per_step": ns.batch * ns.seq,
        "base_width": BASE_WIDTH,
        "best_log2_lr": best,
        "scores": results,
        "seconds": round(time.perf_counter() - start),
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
    }
    Path(f"{ns.out}.json").write_text(json.dumps(record, indent=1))
    plot(results, ns.optim, Path(f"{ns.out}.png"))
    es = sorted(next(iter(next(iter(results.values())).values())))
    print(f"\n| parametrisation | width | {' | '.join(f'lr 2^{e}' for e in es)} | best lr |")
    print(f"| --- | ---: | {' | '.join('---:' for _ in es)} | ---: |")
    for label, by_width in results.items():
        for width, scores in by_width.items():
            cells = [f"**{scores[e]:.3f}**" if e == best[label][width] else f"{scores[e]:.3f}" for e in es]
            print(f"| {label} | {width} | {' | '.join(cells)} | 2^{best[label][width]} |")
    return record


if __name__ == "__main__":
    main()
