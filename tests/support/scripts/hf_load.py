"""Start training from a Hugging Face directory and record what each rank read from it.

Usage: hf_load.py OUT_DIR HF_DIR DEVICES [strategy kwargs as key=value ...]
Writes OUT_DIR/rank<R>.json: bytes of tensor data this rank read from the safetensors files (every
``get_tensor`` / ``get_slice(...)[...]`` result, counted by a wrapper around ``safetensors.safe_open``,
so the count does not rely on the loader's own bookkeeping), the file's total, and the parameters
whose loaded values differ from the file's (gathered to full tensors, compared exactly).
Run as a script: Lightning's launcher re-runs it for the other ranks (hence the __main__ guard).
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import safetensors
import torch

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.data import PretrainDataModule

BYTES_READ = [0]
_ORIGINAL_SAFE_OPEN = safetensors.safe_open


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _CountingSlice:
    def __init__(self, inner) -> None:
        self._inner = inner

    def __getitem__(self, index):
        out = self._inner[index]
        BYTES_READ[0] += _nbytes(out)
        return out

    def __getattr__(self, name):  # get_shape, get_dtype
        return getattr(self._inner, name)


class _CountingSafeOpen:
    """``safetensors.safe_open`` that counts the tensor bytes handed out."""

    def __init__(self, *args, **kwargs) -> None:
        self._inner = _ORIGINAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def get_tensor(self, name):
        out = self._inner.get_tensor(name)
        BYTES_READ[0] += _nbytes(out)
        return out

    def get_slice(self, name):
        return _CountingSlice(self._inner.get_slice(name))

    def __getattr__(self, name):  # keys, metadata, ...
        return getattr(self._inner, name)


def _expected_full(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every parameter as the file holds it, in our layout (read with the uncounted reader)."""
    from lit_titan.models import hf_io
    from lit_titan.models.llama3 import hf

    config = hf_io.read_config(hf_dir)
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    out = {}
    for hf_name, file in hf_io.weight_files(hf_dir).items():
        with _ORIGINAL_SAFE_OPEN(str(file), framework="pt") as f:
            name, tensor = hf.from_hf_tensor(hf_name, f.get_tensor(hf_name), heads, kv)
            out[name] = tensor
    return out


class Record(L.Callback):
    def __init__(self, out_dir: str, hf_dir: str) -> None:
        self.out_dir, self.hf_dir = out_dir, hf_dir

    def on_fit_start(self, trainer, pl_module) -> None:  # after TitanStrategy.setup loaded the weights
        read = BYTES_READ[0]
        expected = _expected_full(self.hf_dir)
        total = sum(_nbytes(t) for t in expected.values())
        wrong, local_bytes = [], 0
        for name, p in pl_module.model.named_parameters():
            local_bytes += _nbytes(p.to_local() if hasattr(p, "to_local") else p)
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective: same order on every rank
            if not torch.equal(full.detach().cpu(), expected[name]):
                wrong.append(name)
        record = {
            "bytes_read": read,
            "total_bytes": total,
            "local_param_bytes": local_bytes,
            "wrong": wrong,
            "world_size": trainer.world_size,
        }
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> None:
    """Also called on every rank of a running world (tests/support/world.py); the counting wrapper is removed
    on return."""
    argv = sys.argv[1:] if argv is None else argv
    out_dir, hf_dir, devices = argv[0], argv[1], int(argv[2])
    kwargs = {}
    for item in argv[3:]:
        key, value = item.split("=", 1)
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    BYTES_READ[0] = 0  # per run: a world runs several cases in one process
    safetensors.safe_open = _CountingSafeOpen  # hf_io.py imports it at call time
    try:
        _fit(out_dir, hf_dir, devices, kwargs)
    finally:
        safetensors.safe_open = _ORIGINAL_SAFE_OPEN


def _fit(out_dir: str, hf_dir: str, devices: int, kwargs: dict) -> None:
    module = PretrainModule(
        "llama3_debug",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512},
        {"total_steps": 1},
        init_from_hf=hf_dir,
    )
    data = PretrainDataModule(
        seq_len=32,
        global_batch_size=8,
        max_bytes=300_000,
        tokenizer={"kind": "bpe", "vocab_size": 512},
        model_vocab_size=512,
        data_dir=os.environ["LIT_TITAN_CACHE"],
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=TitanStrategy(**kwargs),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[Record(out_dir, hf_dir)],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
