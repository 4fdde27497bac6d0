"""Per-rank activation memory under context parallelism, measured.

Activation memory = bytes of the distinct tensor storages autograd saves for backward during one
training forward (``torch.autograd.graph.saved_tensors_hooks``), on each rank. Parameters are
excluded (they are not activations), so the number isolates what CP is meant to cut.

Usage (Lightning launches the other processes):
    python benchmarks/cp_activation_memory.py --seq-len 2048 --cp 1 2 4 [--mode allgather ulysses ring]
Prints a table: mode, cp, processes, seq_len, per-rank activation MiB (max over ranks), ratio to cp=1.

    python benchmarks/cp_activation_memory.py --core --seq-len 2048 4096 8192 16384 --cp 2 4
The attention core alone, per mode (``parallel.cp_mode``): the bytes one layer's CP attention saves for
backward on each rank, at llama3_debug's shapes (16 heads, 8 KV heads, head_dim 16, one sequence, fp32),
in a gloo world of cp processes; forward only, so long sequences run in seconds on CPU. The rest of a
block is the same in every mode (1/cp of one process's); the modes differ only here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import lightning as L
import torch


def _storage(p: torch.Tensor) -> int:
    return (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()


class SavedTensorBytes(L.Callback):
    """Counts distinct storages saved for backward between batch start and backward."""

    def __init__(self, out: str) -> None:
        self.out, self.ctx, self.seen, self.bytes = out, None, set(), 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        def pack(t):
            t_local = t.to_local() if hasattr(t, "to_local") else t
            ptr = t_local.untyped_storage().data_ptr()
            # Parameters are not activations; under FSDP the module holds the all-gathered
            # (unsharded) ones during its forward, so look them up at pack time.
            params = {_storage(p) for p in pl_module.parameters()}
            if ptr not in self.seen and ptr not in params:
                self.seen.add(ptr)
                self.bytes += t_local.untyped_storage().nbytes()
            return t

        self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.ctx.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None
            with open(f"{self.out}.rank{trainer.global_rank}", "w") as f:
                json.dump({"rank": trainer.global_rank, "bytes": self.bytes}, f)


def worker(seq_len: int, cp: int, out: str, mode: str = "allgather") -> None:
    from lit_titan import PretrainModule, TitanStrategy
    from lit_titan.data import PretrainDataModule

    module = PretrainModule("llama3_debug", {"vocab_size": 4096}, {"total_steps": 1})
    data = PretrainDataModule(
        seq_len=seq_len,
        global_batch_size=1,
        tokenizer={"kind": "bpe", "vocab_size": 4096},
        model_vocab_size=4096,
        data_dir=os.path.expanduser("~/.cache/lit_titan"),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cp,
        strategy=TitanStrategy(cp=cp, cp_mode=mode),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=[SavedTensorBytes(out)],
    )
    trainer.fit(module, datamodule=data)


def core_worker(rank: int, cp: int, port: int, seqs: list[int], modes: list[str], out: str) -> None:
    """One rank of the core measurement: every (mode, seq) in turn, saved bytes of one forward."""
    import torch.distributed as dist

    from lit_titan.strategies.context_parallel import ContextParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.set_num_threads(1)
    heads, kv_heads, head_dim = 16, 8, 16  # llama3_debug
    results = {}
    for mode in modes:
        engine = ContextParallel(dist.group.WORLD, mode)
        for seq in seqs:
            local = seq // cp
            q = torch.randn(1, heads, local, head_dim, requires_grad=True)
            k, v = (torch.randn(1, kv_heads, local, head_dim, requires_grad=True) for _ in range(2))
            saved: dict[int, int] = {}

            def pack(t, saved=saved):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            masks: dict = {}  # all-gather's CPU prefix masks: one per shape, shared by every layer
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                engine.core(None, masks)(q, k, v)
            shared = {m.untyped_storage().data_ptr() for m in masks.values()}
            results[f"{mode} {seq}"] = sum(n for ptr, n in saved.items() if ptr not in shared)
            results[f"{mode} {seq} mask"] = sum(n for ptr, n in saved.items() if ptr in shared)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def core_table(seqs: list[int], cps: list[int], modes: list[str]) -> None:
    import torch.multiprocessing as mp

    print(
        "| mode | cp | seq_len | attention saved MiB per rank per layer (max) | x local K/V (2 x seq/cp x 8 x 16 fp32) "
        "| + CPU mask shared by all layers, MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for cp in cps:
            out = os.path.join(tmp, f"core{cp}")
            mp.spawn(core_worker, args=(cp, 29500 + cp, seqs, modes, out), nprocs=cp)
            per_rank = [json.load(open(f"{out}.rank{r}")) for r in range(cp)]
            for mode in modes:
                for seq in seqs:
                    mib = max(r[f"{mode} {seq}"] for r in per_rank) / 2**20
                    mask = max(r[f"{mode} {seq} mask"] for r in per_rank) / 2**20
                    local_kv = 2 * seq / cp * 8 * 16 * 4 / 2**20
                    print(f"| {mode} | {cp} | {seq} | {mib:.2f} | {mib / local_kv:.2f} | {mask:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mode", nargs="+", default=["allgather"], choices=["allgather", "ulysses", "ring"])
    parser.add_argument("--core", action="store_true", help="the attention core alone, forward only (long sequences)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.core:
        core_table(args.seq_len, [c for c in args.cp if c > 1], args.mode)
        return
    if args.worker:
        worker(args.seq_len[0], args.cp[0], args.out, args.mode[0])
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.mode:
            for cp in args.cp:
                if cp == 1 and rows:
                    continue  # one process: no CP, the same in every mode
                out = os.path.join(tmp, f"{mode}-cp{cp}")
                seq = args.seq_len[0]
                cmd = [sys.executable, __file__, "--worker", "--seq-len", str(seq), "--cp", str(cp), "--out", out]
                subprocess.run([*cmd, "--mode", mode], check=True, capture_output=True)
                per_rank = [json.load(open(f"{out}.rank{r}"))["bytes"] for r in range(cp)]
                rows.append((mode, cp, max(per_rank) / 2**20))
    base = rows[0][2]
    print(f"| mode | cp | processes | seq_len | activation MiB per rank (max) | vs cp={rows[0][1]} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, cp, mib in rows:
        print(f"| {mode} | {cp} | {cp} | {args.seq_len[0]} | {mib:.1f} | {mib / base:.3f} |")


if __name__ == "__main__":
    main()
