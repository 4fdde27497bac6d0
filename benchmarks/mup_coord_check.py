"""muP coordinate check: every layer's activation scale over the first steps, at three widths, with and without muP.

Under muP (``model.mup=true``) the typical size of each layer's output coordinates stays the same as
the width grows, at init and after updates; under the standard parametrisation (SP) the hidden
activations and logits grow with width once Adam has taken a step (each update moves every
coordinate by ~lr, summed over a fan-in that grows). This measures mean |x| of the output of the
embedding, every block's attention, feed-forward and block output, the final norm and the logits,
before each of the first ``--steps`` optimizer steps, for a tiny Llama (2 layers, 4 heads, byte-level
vocabulary of 256) trained on the Python standard library's source (the corpus ``data.corpus=stdlib``
reads) on one process, CPU. The slope of log2(scale) against log2(width) at the last step is the
summary: ~0 with muP, positive without. The muP paper (Yang et al. 2022) Figure 5 is the same check.

    python benchmarks/mup_coord_check.py                       # writes mup_coord_check.{json,png}
    python benchmarks/mup_coord_check.py --optim muon --lr 2e-2
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import torch

from lit_titan.models.llama3.args import ModelArgs
from lit_titan.models.llama3.model import Transformer
from lit_titan.optim.build import build_optimizer, build_scheduler
from lit_titan.optim.settings import OptimConfig

WIDTHS = (64, 128, 256)
BASE_WIDTH = 64
VOCAB = 256  # bytes


def tiny_args(width: int, mup: bool, base: int = BASE_WIDTH, n_layers: int = 2, seq: int = 64) -> ModelArgs:
    """The tiny Llama at ``width`` (4 heads: the head dim grows with the width, as muP's attention scale assumes)."""
    return ModelArgs(
        dim=width,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        multiple_of=32,
        max_seq_len=seq,
        rope_scaling=None,
        mup=mup,
        mup_base_width=base if mup else None,
    )


def text_bytes(n: int = 4_000_000) -> torch.Tensor:
    """The first ``n`` bytes of the standard library's sorted .py files (deterministic, local, real text)."""
    chunks, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= n:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:n]), dtype=torch.uint8).long()


def batches(text: torch.Tensor, steps: int, batch: int = 16, seq: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches of ``seq + 1`` bytes at random offsets (the same for every width and lr)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, len(text) - seq - 1, (batch,), generator=gen)
        out.append(torch.stack([text[s : s + seq + 1] for s in start.tolist()]))
    return out


def measured_modules(model: Transformer) -> dict[str, torch.nn.Module]:
    mods = {"embedding": model.tok_embeddings}
    for key, block in model.layers.items():
        mods[f"layers.{key}.attention"] = block.attention
        mods[f"layers.{key}.feed_forward"] = block.feed_forward
        mods[f"layers.{key}"] = block
    mods["norm"] = model.norm
    mods["logits"] = model.output
    return mods


def train(
    args: ModelArgs,
    optim: str,
    lr: float,
    data: list[torch.Tensor],
    warmup: int = 0,
    measure: bool = False,
    seed: int = 0,
) -> tuple[list[float], dict[str, list[float]]]:
    """Train on ``data`` (one step per batch): the losses, and (``measure``) each module's mean |output| before each step."""
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights(seed=seed)
    cfg = OptimConfig(
        name=optim, lr=lr, weight_decay=0.0, warmup_steps=warmup, total_steps=len(data), schedule="cosine"
    )
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    scales: dict[str, list[float]] = {}
    hooks = []
    if measure:
        for name, mod in measured_modules(model).items():

            def hook(_m, _i, out, name=name):
                if not torch.is_grad_enabled():  # the measuring forward only (the training one returns the loss)
                    scales.setdefault(name, []).append(out.detach().abs().mean().item())

            hooks.append(mod.register_forward_hook(hook))
    losses = []
    for tokens in data:
        if measure:
            with torch.no_grad():
                model(tokens[:, :-1])  # logits, for the hooks
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    for h in hooks:
        h.remove()
    return losses, scales


def coord_check(
    widths: tuple[int, ...] = WIDTHS, mup: bool = True, optim: str = "adamw", lr: float = 1e-2, steps: int = 5
) -> dict[int, dict[str, list[float]]]:
    """{width: {module: [mean |output| before step 0, 1, ...]}} on the same batches.

    64 tokens per step (2 x 32), no more than the smallest width: muP's claim is about width growing
    with the batch fixed. With many more tokens than coordinates, an Adam step's alignment with any one
    input averages out and hidden updates behave as a random walk over the fan-in (~ sqrt(width) x lr / m,
    a slope of -1/2 under muP): seen with 1,024 tokens per step at these widths, the feed-forward
    outputs' slope was -0.4 to -0.7.
    """
    data = batches(text_bytes(200_000), steps, batch=2, seq=32)
    return {w: train(tiny_args(w, mup), optim, lr, data, measure=True)[1] for w in widths}


def slopes(scales: dict[int, dict[str, list[float]]], step: int = -1) -> dict[str, float]:
    """Least-squares slope of log2(mean |x|) against log2(width), per module, at ``step``."""
    widths = sorted(scales)
    xs = [math.log2(w) for w in widths]
    mx = sum(xs) / len(xs)
    out = {}
    for name in scales[widths[0]]:
        ys = [math.log2(scales[w][name][step]) for w in widths]
        my = sum(ys) / len(ys)
        out[name] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return out


def plot(results: dict[str, dict[int, dict[str, list[float]]]], path: Path) -> None:
    """One panel per parametrisation: mean |x| against width, one line per (module, step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), sharey=True, squeeze=False)
    for ax, (label, scales) in zip(axes[0], results.items()):
        widths = sorted(scales)
        names = list(scales[widths[0]])
        colors = plt.cm.viridis([i / max(len(names) - 1, 1) for i in range(len(names))])
        for color, name in zip(colors, names):
            steps = len(scales[widths[0]][name])
            for t in range(steps):
                ax.plot(
                    widths,
                    [scales[w][name][t] for w in widths],
                    color=color,
                    alpha=0.25 + 0.75 * (t + 1) / steps,
                    marker="o",
                    markersize=3,
                    label=name if t == steps - 1 else None,
                )
        ax.set(xscale="log", yscale="log", xlabel="width (model.dim)", title=label)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][0].set_ylabel("mean |output| (darker: later step)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--optim", default="adamw", choices=("adamw", "muon"))
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="mup_coord_check", help="path stem of the .json and .png written")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny Python-bound steps
    results = {
        label: coord_check(tuple(ns.widths), mup, ns.optim, ns.lr, ns.steps)
        for label, mup in (("SP (model.mup=false)", False), (f"muP (base width {BASE_WIDTH})", True))
    }
    summary = {label: slopes(scales) for label, scales in results.items()}
    record = {
        "optim": ns.optim,
        "lr": ns.lr,
        "steps": ns.steps,
        "widths": ns.widths,
        "slope_at_last_step": summary,
        "scales": {label: {str(w): s for w, s in scales.items()} for label, scales in results.items()},
    }
    Path(f"{ns.out}.json").write_text(json.dumps(record, indent=1))
    plot(results, Path(f"{ns.out}.png"))
    print(f"| module | {' | '.join(summary)} |\n| --- | --- | --- |")
    for name in summary[next(iter(summary))]:
        print(f"| {name} | {' | '.join(f'{s[name]:+.2f}' for s in summary.values())} |")
    return record


if __name__ == "__main__":
    main()
