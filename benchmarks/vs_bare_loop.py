"""The reference: lit-titan against a bare PyTorch loop over the same model and shapes.

The bare loop trains the *same* ``lit_titan.models.llama3.Transformer`` without Lightning:
``fully_shard`` per block and on the root (bf16 params, fp32 gradient reduction), optional
per-block ``torch.compile``, ``torch.optim.AdamW(fused=True)`` on CUDA, fp32 cross-entropy and
grad-norm clipping at 1.0, on random tokens of lit-titan's batch shape ``[micro, seq_len + 1]``.
lit-titan runs through ``python -m lit_titan.train`` exactly as ``gpu_features.py`` drives it.
Each row is one bare run and one lit-titan run, each in its own process (fresh CUDA memory
statistics and compile caches; ``--cpu-smoke`` runs them all in one child process to save
start-up time); both report mean tokens/s over ``--steps`` steps after ``--warmup`` steps, a
step's time running from the end of the previous step (synchronised on CUDA).

    python benchmarks/vs_bare_loop.py --layers 4 --json vs_bare.json > vs_bare.md
    python benchmarks/vs_bare_loop.py --only bf16_compile --lit-override optim.fused=true
    python benchmarks/vs_bare_loop.py --cpu-smoke          # plumbing only: tiny fp32 model, gloo, no compile

``--cpu-smoke`` numbers mean nothing (no compile; Float8 emulated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_features  # noqa: E402  (the lit-titan side: one `python -m lit_titan.train` per configuration)

# Row name (a gpu_features.CONFIGS key, so the lit-titan run is that configuration) -> the bare loop's options.
ROWS: dict[str, dict] = {
    "bf16_eager": {},
    "bf16_compile": {"compile": True},
    "compile_float8_tensorwise": {"compile": True, "float8": "tensorwise"},
    "compile_float8_rowwise": {"compile": True, "float8": "rowwise"},
    "compile_ac_selective_op": {"compile": True, "selective_ac": True},
}
GIB = 1024**3


# ---- the bare loop ------------------------------------------------------------------------------
def build_model(model_args, opts: dict, device, mesh, bf16: bool, smoke: bool):
    """Meta model -> Float8 -> selective AC -> compile -> FSDP2 -> seeded weights (lit-titan's order)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lit_titan.models.llama3 import Transformer

    with torch.device("meta"):
        model = Transformer(model_args)
    if opts.get("float8"):
        from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

        recipe = opts["float8"]
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(recipe),
            emulate=smoke,  # smoke: no FP8 units
            enable_fsdp_float8_all_gather=recipe == "tensorwise",
        )
        keep = (lambda m, fqn: "output" not in fqn) if smoke else _auto_filter_for_recipe(recipe, ["output"])
        convert_to_float8_training(model, config=config, module_filter_fn=keep)
    for key, block in list(model.layers.items()):
        if opts.get("selective_ac"):
            block = selective_checkpoint(block)
        if opts.get("compile"):
            block.compile(fullgraph=True)
        model.layers[key] = block
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights(seed=0, buffer_device=device)
    return model


def selective_checkpoint(block):
    """Non-reentrant AC keeping matmul, attention and FP8-matmul outputs (lit-titan's selective_op save list)."""
    from functools import partial

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return checkpoint_wrapper(
        block,
        checkpoint_fn=checkpoint,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=partial(create_selective_checkpoint_contexts, policy),
    )


def bare_run(name: str, args: argparse.Namespace) -> dict:
    """Train ``--warmup + --steps`` steps of row ``name``; mean tokens/s of the last ``--steps``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lit_titan.models.llama3 import get_flavor

    opts = dict(ROWS[name])
    cuda = not args.cpu_smoke
    if args.cpu_smoke:
        opts.pop("compile", None)  # inductor's cold start would dominate the smoke test
        model_args = get_flavor("llama3_debug", **gpu_features.SMOKE_MODEL)
        vocab = model_args.vocab_size
    else:
        model_args, vocab = get_flavor("llama3_8b", n_layers=args.layers), args.tokenizer_vocab
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(0)
    model = build_model(model_args, opts, device, mesh, bf16=cuda, smoke=args.cpu_smoke)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cuda,
    )
    precompute_scales = opts.get("float8") == "tensorwise"
    seq_len = gpu_features.SMOKE_SEQ_LEN if args.cpu_smoke else args.seq_len
    rates, loss = [], None
    t_prev = time.perf_counter()
    for step in range(args.warmup + args.steps):
        batch = torch.randint(0, vocab, (1, seq_len + 1))  # a loader's batch: [micro, seq_len + 1] on the host
        batch = (batch.pin_memory() if cuda else batch).to(device, non_blocking=True)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if precompute_scales:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        if cuda:
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if step >= args.warmup:
            rates.append(inputs.numel() / (now - t_prev))
        t_prev = now
    out = {
        "name": name,
        "tokens_per_sec": sum(rates) / len(rates),
        "final_loss": loss.item(),
        "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
        "checkpointed_blocks": sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules()),
    }
    if cuda:
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    del model, optimizer
    return out


# ---- the side-by-side driver --------------------------------------------------------------------
def lit_in_process(
    name: str, args: argparse.Namespace, root: Path, smoke_model: dict[str, int] = gpu_features.SMOKE_MODEL
) -> dict:
    """CPU smoke only: the row's lit-titan run through ``lit_titan.train.main`` in this (child) process.

    Same overrides as the ``python -m lit_titan.train`` run of a GPU table; one process for the whole smoke
    table because interpreter and import start-up (~10 s of CPU per process) would otherwise dominate it.
    """
    from lit_titan.train import main as train_main

    run_dir = root / name
    try:
        train_main(
            gpu_features.lit_overrides(gpu_features.CONFIGS[name] + args.lit_override, args, run_dir, smoke_model)
        )
    except Exception as err:  # noqa: BLE001  (a failed row is reported in the table, like a failed process)
        return {"name": name, "error": f"{type(err).__name__}: {err}"[:200]}
    return gpu_features.read_result(name, run_dir, args)


def run_child(names: list[str], args: argparse.Namespace) -> list[dict]:
    """This script in a child process for ``names``: the bare loop (and, for --cpu-smoke, lit-titan too)."""
    forwarded = [
        "--layers",
        str(args.layers),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--tokenizer-vocab",
        str(args.tokenizer_vocab),
        *[f"--lit-override={o}" for o in args.lit_override],
        *(["--cpu-smoke"] if args.cpu_smoke else []),
    ]
    proc = subprocess.run([sys.executable, __file__, "--child", *names, *forwarded], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rows"')]
    if proc.returncode != 0 or not lines:
        error = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        return [{"name": n, "bare": {"error": error}, "lit": {"error": error}} for n in names]
    return json.loads(lines[-1])["rows"]


def child(names: list[str], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lit = {n: lit_in_process(n, args, Path(tmp)) for n in names} if args.cpu_smoke else {}
    rows = [{"name": n, "bare": bare_run(n, args), "lit": lit.get(n, {})} for n in names]
    print(json.dumps({"rows": rows}))


def side_by_side(names: list[str], args: argparse.Namespace) -> list[dict]:
    if args.cpu_smoke:
        return run_child(names, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:  # on a GPU every run has a process of its own
            row = run_child([name], args)[0]
            row["lit"] = gpu_features.run_config(name, gpu_features.CONFIGS[name] + args.lit_override, args, Path(tmp))
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| configuration | bare loop tok/s | lit-titan tok/s | lit / bare | bare peak GiB | lit peak GiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        bare, lit = r["bare"], r["lit"]
        b, t = bare.get("tokens_per_sec"), lit.get("perf/tokens_per_sec_per_device")
        ratio = f"{t / b:.2f}" if b and t else ""
        mem = lambda d, k: f"{d[k]:.1f}" if k in d else "n/a"  # noqa: E731
        lines.append(
            f"| {r['name']} | {f'{b:,.0f}' if b else 'failed: ' + bare.get('error', '?')} | "
            f"{f'{t:,.0f}' if t else 'failed: ' + lit.get('error', '?')} | {ratio} | "
            f"{mem(bare, 'max_memory_allocated_gib')} | {mem(lit, 'perf/max_memory_allocated_gib')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--warmup", type=int, default=4, help="steps before measuring (compile, allocator)")
    parser.add_argument(
        "--tokenizer-vocab",
        type=int,
        default=32000,
        help="token ids drawn below this (lit-titan's BPE); the model keeps 128256 rows",
    )
    parser.add_argument("--only", nargs="+", choices=list(ROWS), default=None)
    parser.add_argument(
        "--lit-override",
        action="append",
        default=[],
        help="extra Hydra override for every lit-titan run, e.g. optim.fused=true",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 model on CPU: checks the script only")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    parser.add_argument("--child", nargs="+", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        return child(args.child, args)
    rows = side_by_side(args.only or list(ROWS), args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"Command: python benchmarks/vs_bare_loop.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(gpu_features.environment())
    shape = (
        f"CPU smoke test: llama3_debug with {gpu_features.SMOKE_MODEL}, seq {gpu_features.SMOKE_SEQ_LEN}, fp32, "
        "gloo, no compile, Float8 emulated (numbers mean nothing)"
        if args.cpu_smoke
        else f"Llama 3.1 8B widths, {args.layers} layers, seq {args.seq_len}, micro-batch 1, global batch 1, "
        f"bf16-mixed, FSDP2 on a one-GPU mesh"
    )
    print(f"Model: {shape}; mean tokens/s over {args.steps} steps after {args.warmup} warm-up steps\n")
    print(table(rows))


if __name__ == "__main__":
    main()
