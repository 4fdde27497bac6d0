"""The peer benchmark: the same Llama trained by TorchTitan 0.3.0 and by lit-titan, one GPU.

Llama 3.1 8B widths with ``--layers`` blocks (4: 1,923,125,248 parameters in both; the script
checks the counts match), seq_len ``--seq-len``, micro-batch 1 = global batch 1, bf16 params with
fp32 gradient reduction under FSDP2 on a one-GPU mesh, AdamW fused, grad-norm clip 1.0, random
tokens. TorchTitan runs through its own ``Trainer`` built from a ``Trainer.Config`` here in Python
(its recipes are Python, not TOML), with a random-token ``BaseDataLoader`` and a tokenizer stub
(its recipes read a dataset and tokenizer that the wheel does not ship). Its own choices are kept
and printed: flex attention, chunked cross-entropy (``--plain-ce`` for plain), CUDA graphs of
forward+backward, GC control. lit-titan runs ``python -m lit_titan.train`` as in ``gpu_features.py``.
Each run is its own process; tokens/s is the mean over ``--steps`` steps after ``--warmup``, a
step's time running from the end of the previous one (synchronised on CUDA), as lit-titan's
``ThroughputMonitor`` measures it.

    pip install torchtitan==0.3.0          # or: pip install '.[bench]'
    python benchmarks/vs_torchtitan.py --layers 4 --json vs_torchtitan.json > vs_torchtitan.md
    python benchmarks/vs_torchtitan.py --cpu-smoke     # plumbing only: tiny fp32 model, gloo, no compile

``--cpu-smoke`` numbers mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_features  # noqa: E402
from vs_bare_loop import lit_in_process  # noqa: E402

# Row name (a gpu_features.CONFIGS key: the lit-titan run) -> TorchTitan's options for the same work.
# TorchTitan 0.3.0's Float8 converter names only the rowwise recipes, so there is no tensorwise row.
ROWS: dict[str, dict] = {
    "bf16_eager": {},
    "bf16_compile": {"compile": True},
    "compile_ac_selective_op": {"compile": True, "selective_ac": True},
    "compile_float8_rowwise": {"compile": True, "float8": "rowwise"},
}
# --cpu-smoke: TorchTitan's "debugmodel" flavor cut to 2 blocks, and lit-titan's llama3_debug in the same shape.
SMOKE_MODEL = {"n_layers": 2, "dim": 256, "n_heads": 16, "n_kv_heads": 16, "vocab_size": 2048}
GIB = 1024**3


# ---- TorchTitan ---------------------------------------------------------------------------------
def import_torchtitan(cpu: bool = False):
    """Import TorchTitan's Trainer, with stand-ins for two packages it imports but this run never uses.

    ``datasets`` (its HF data path) and ``torch.utils.tensorboard`` (its metrics module) are imported at
    load time; the GPU image may lack them, and the random-token loader needs neither. ``cpu``: TorchTitan
    picks CUDA when no accelerator is found, so the smoke test points its device globals at the CPU
    before the modules that copy them are imported.
    """
    if cpu:
        import torch
        import torchtitan.tools.utils as tt_utils

        cpu_module = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if k[0] != "_"})
        cpu_module.__dict__.update(  # the CUDA memory statistics its metrics read: zeros on CPU
            get_device_name=lambda *a: "cpu",
            current_device=lambda: 0,
            empty_cache=lambda: None,
            get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1),
            reset_peak_memory_stats=lambda *a: None,
            memory_stats=lambda *a: collections.defaultdict(int),
        )
        tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    try:
        import datasets  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")
        stub.Dataset, stub.load_dataset = object, None
        sys.modules["datasets"] = stub
        sys.modules["datasets.distributed"] = types.SimpleNamespace(split_dataset_by_node=None)
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=None)
    from torchtitan.trainer import Trainer

    return Trainer


def tt_components():
    """A random-token loader and a tokenizer stub, as TorchTitan ``Configurable`` components."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class RandomTokens(BaseDataLoader):
        """``local_batch_size`` x ``seq_len`` random tokens, one document per sequence (positions 0..s-1)."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            high: int = 32000

        def __init__(self, config, *, local_batch_size: int, seq_len: int, **_) -> None:
            self.high, self.shape = config.high, (local_batch_size, seq_len + 1)

        def __iter__(self):
            positions = torch.arange(self.shape[1] - 1).expand(self.shape[0], -1)
            while True:
                tokens = torch.randint(0, self.high, self.shape)
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    class StubTokenizer(BaseTokenizer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 128256

        def __init__(self, config, **_) -> None:
            super().__init__()
            self.vocab_size, self.eos_id = config.vocab_size, 0

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("random tokens only")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("random tokens only")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    return RandomTokens, StubTokenizer


def tt_config(name: str, args: argparse.Namespace, dump_folder: str):
    """TorchTitan's ``Trainer.Config`` for row ``name`` (its 8B recipe with fewer blocks)."""
    Trainer = import_torchtitan(cpu=args.cpu_smoke)
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry

    RandomTokens, StubTokenizer = tt_components()
    opts, smoke = ROWS[name], args.cpu_smoke
    compile_on = bool(opts.get("compile")) and not smoke  # inductor's cold start would dominate the smoke test
    converters = []
    if opts.get("float8"):  # smoke: no FP8 units, so torchao's emulation (TorchTitan allows it without compile)
        # LM head in bf16 (its 405B recipe); auto_filter_small_kn: torchao's small-GEMM filter, as lit-titan's default
        skip = ["lm_head", *([] if smoke else ["auto_filter_small_kn"])]
        converters = [
            Float8LinearConverter.Config(
                recipe_name=opts["float8"], emulate=smoke, filter_fqns=skip, model_compile_enabled=compile_on
            )
        ]
    spec = model_registry("debugmodel" if smoke else "8B", converters=converters)
    spec.model.layers = spec.model.layers[: SMOKE_MODEL["n_layers"] if smoke else args.layers]
    if smoke or args.tt_sdpa:  # flex attention has no backward on CPU
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    ce = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
    return Trainer.Config(
        model_spec=spec,
        dump_folder=dump_folder,
        hf_assets_path=dump_folder,
        tokenizer=StubTokenizer.Config(vocab_size=decoder_vocab_size(spec)),
        dataloader=RandomTokens.Config(high=SMOKE_MODEL["vocab_size"] if smoke else args.tokenizer_vocab),
        loss=ce if args.plain_ce else ChunkedLossWrapper.Config(loss_fn=ce),
        optimizer=default_adamw(lr=1e-4),
        training=TrainingConfig(
            local_batch_size=1,
            seq_len=args.smoke_seq_len if smoke else args.seq_len,
            steps=args.warmup + args.steps,
            max_norm=1.0,
            disable_cuda_graphs=smoke or args.tt_no_cuda_graphs,
            mixed_precision_param="float32" if smoke else "bfloat16",
        ),
        compile=CompileConfig(enable=compile_on),
        activation_checkpoint=SelectiveAC.Config() if opts.get("selective_ac") else None,
        metrics=MetricsProcessor.Config(log_freq=10),
    )


def tt_run(name: str, args: argparse.Namespace) -> dict:
    """TorchTitan's training of row ``name`` in this process: mean tokens/s, peak memory, parameters."""
    import torch
    import torch.distributed as dist

    port = args.port or _free_port()
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ[key] = value
    if dist.is_initialized():  # the smoke child ran lit-titan first, in this process
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        config = tt_config(name, args, tmp)
        trainer = config.build()
        ends: list[float] = []
        inner = trainer.train_step

        def timed_step(data_iterator) -> None:
            inner(data_iterator)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

        trainer.train_step = timed_step
        try:
            trainer.train()
        finally:
            trainer.close()
    tokens = config.training.local_batch_size * config.training.seq_len
    rates = [tokens / (b - a) for a, b in zip(ends[args.warmup - 1 :], ends[args.warmup :])]
    out = {
        "name": name,
        "tokens_per_sec": sum(rates) / len(rates),
        "params": sum(p.numel() for m in trainer.model_parts for p in m.parameters()),
    }
    if torch.cuda.is_available():
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- driver -------------------------------------------------------------------------------------
def lit_params(args: argparse.Namespace) -> int:
    from lit_titan.models.llama3 import get_flavor
    from lit_titan.models.llama3.flops import count_params

    if args.cpu_smoke:
        return count_params(get_flavor("llama3_debug", **SMOKE_MODEL))
    return count_params(get_flavor("llama3_8b", n_layers=args.layers))


def child(names: list[str], args: argparse.Namespace) -> None:
    """One JSON line of rows: TorchTitan's runs (and, for --cpu-smoke, lit-titan's, in this process too)."""
    lit = {}
    if args.cpu_smoke:  # lit-titan first: TorchTitan's import changes global inductor settings
        with tempfile.TemporaryDirectory() as tmp:
            lit = {n: lit_in_process(n, args, Path(tmp), smoke_model=SMOKE_MODEL) for n in names}
    rows = []
    for name in names:
        try:
            tt = tt_run(name, args)
        except Exception as err:  # noqa: BLE001  (reported in the table)
            tt = {"name": name, "error": f"{type(err).__name__}: {err}"[:200]}
        rows.append({"name": name, "torchtitan": tt, "lit": lit.get(name, {})})
    print(json.dumps({"rows": rows}))


def run_child(names: list[str], args: argparse.Namespace) -> list[dict]:
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
        "--port",
        str(args.port),
        *[f"--lit-override={o}" for o in args.lit_override],
        *(["--plain-ce"] if args.plain_ce else []),
        *(["--tt-sdpa"] if args.tt_sdpa else []),
        *(["--tt-no-cuda-graphs"] if args.tt_no_cuda_graphs else []),
        *(["--cpu-smoke"] if args.cpu_smoke else []),
    ]
    proc = subprocess.run([sys.executable, __file__, "--child", *names, *forwarded], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rows"')]
    if proc.returncode != 0 or not lines:
        error = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        return [{"name": n, "torchtitan": {"error": error}, "lit": {"error": error}} for n in names]
    return json.loads(lines[-1])["rows"]


def side_by_side(names: list[str], args: argparse.Namespace) -> list[dict]:
    if args.cpu_smoke:
        return run_child(names, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = run_child([name], args)[0]
            row["lit"] = gpu_features.run_config(name, gpu_features.CONFIGS[name] + args.lit_override, args, Path(tmp))
            rows.append(row)
    return rows


def table(rows: list[dict], lit_count: int) -> str:
    lines = [
        "| configuration | TorchTitan tok/s | lit-titan tok/s | lit / TorchTitan | TorchTitan peak GiB | "
        "lit-titan peak GiB | parameters (TorchTitan / lit-titan) |",
        "|" + " --- |" * 7,
    ]
    for r in rows:
        tt, lit = r["torchtitan"], r["lit"]
        a, b = tt.get("tokens_per_sec"), lit.get("perf/tokens_per_sec_per_device")
        mem = lambda d, k: f"{d[k]:.1f}" if k in d else "n/a"  # noqa: E731
        params = f"{tt['params']:,} / {lit_count:,}" if "params" in tt else ""
        lines.append(
            f"| {r['name']} | {f'{a:,.0f}' if a else 'failed: ' + tt.get('error', '?')} | "
            f"{f'{b:,.0f}' if b else 'failed: ' + lit.get('error', '?')} | {f'{b / a:.2f}' if a and b else ''}"
            f" | {mem(tt, 'max_memory_allocated_gib')} | {mem(lit, 'perf/max_memory_allocated_gib')} | "
            f"{params} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--warmup", type=int, default=4, help="steps before measuring (compile, CUDA graphs)")
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
    parser.add_argument("--plain-ce", action="store_true", help="TorchTitan: plain instead of chunked cross-entropy")
    parser.add_argument(
        "--tt-no-cuda-graphs",
        action="store_true",
        help="TorchTitan: no CUDA graph of forward+backward (on by default in 0.3.0)",
    )
    parser.add_argument(
        "--tt-sdpa",
        action="store_true",
        help="TorchTitan: causal SDPA (cuDNN, flash, math) instead of its default flex attention",
    )
    parser.add_argument("--port", type=int, default=0, help="TorchTitan's rendezvous port (0: a free one)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 model on CPU: checks the script only")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    parser.add_argument("--child", nargs="+", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.smoke_seq_len = gpu_features.SMOKE_SEQ_LEN
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        return child(args.child, args)
    rows = side_by_side(args.only or list(ROWS), args)
    lit_count = lit_params(args)
    if args.json:
        args.json.write_text(json.dumps({"lit_params": lit_count, "rows": rows}, indent=2))
    print(f"Command: python benchmarks/vs_torchtitan.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    try:
        from importlib.metadata import version

        tt_version = version("torchtitan")
    except Exception:  # noqa: BLE001
        tt_version = "missing"
    print(f"{gpu_features.environment()}; torchtitan {tt_version}")
    shape = (
        f"CPU smoke test: {SMOKE_MODEL}, seq {gpu_features.SMOKE_SEQ_LEN}, fp32, gloo, no compile, Float8 "
        "emulated (numbers mean nothing)"
        if args.cpu_smoke
        else f"Llama 3.1 8B widths, {args.layers} layers, seq {args.seq_len}, micro-batch 1, global batch 1, bf16 "
        "params / fp32 reduce, FSDP2 on one GPU"
    )
    print(f"Model: {shape}; mean tokens/s over {args.steps} steps after {args.warmup} warm-up steps")
    attention = "SDPA" if args.tt_sdpa or args.cpu_smoke else "flex"
    print(
        f"TorchTitan's own choices: {attention} attention, {'plain' if args.plain_ce else 'chunked'} cross-entropy, "
        f"{'no CUDA graphs' if args.cpu_smoke or args.tt_no_cuda_graphs else 'CUDA graph of forward+backward'}, "
        "GC every 50 steps, metrics every 10 steps\n"
    )
    print(table(rows, lit_count))


if __name__ == "__main__":
    main()
