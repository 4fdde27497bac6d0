"""Per-rank activation memory under context parallelism, measured.

Activation memory = bytes of the distinct tensor storages autograd saves for backward during one
training forward (``torch.autograd.graph.saved_tensors_hooks``), on each rank. Parameters are
excluded (they are not activations), so the number isolates what CP is meant to cut.

Usage (Lightning launches the other processes):
    python benchmarks/cp_activation_memory.py --seq-len 2048 --cp 1 2 4
Prints a table: cp, processes, seq_len, per-rank activation MiB (max over ranks), ratio to cp=1.
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


def worker(seq_len: int, cp: int, out: str) -> None:
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
        strategy=TitanStrategy(cp=cp),
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.seq_len, args.cp[0], args.out)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            out = os.path.join(tmp, f"cp{cp}")
            subprocess.run(
                [sys.executable, __file__, "--worker", "--seq-len", str(args.seq_len), "--cp", str(cp), "--out", out],
                check=True,
                capture_output=True,
            )
            per_rank = [json.load(open(f"{out}.rank{r}"))["bytes"] for r in range(cp)]
            rows.append((cp, max(per_rank) / 2**20))
    base = rows[0][1]
    print(f"| cp | processes | seq_len | activation MiB per rank (max) | vs cp={rows[0][0]} |")
    print("| --- | --- | --- | --- | --- |")
    for cp, mib in rows:
        print(f"| {cp} | {cp} | {args.seq_len} | {mib:.1f} | {mib / base:.3f} |")


if __name__ == "__main__":
    main()
