"""ThroughputMonitor: FLOPs formula, peak table, per-device arithmetic and a real CPU fit."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lit_titan
from lit_titan.callbacks.throughput import ThroughputMonitor
from lit_titan.models.llama3 import Transformer, get_flavor
from lit_titan.models.llama3.flops import count_params, flops_per_token
from lit_titan.observe.throughput import peak_bf16_tflops, per_device_throughput

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}


def test_flops_per_token_small_config_by_hand():
    args = get_flavor("llama3_debug", **TINY)  # multiple_of=256 from the debug flavor
    # head_dim = 64 / 4 = 16; ffn hidden = int(2 * 4 * 64 / 3) = 170 -> rounded up to 256.
    attention = 64 * 64 + 64 * 64 + 64 * 32 + 64 * 32  # wq, wo, wk, wv (2 kv heads * 16)  = 12,288
    ffn = 3 * 64 * 256  # w1, w2, w3                                                     = 49,152
    block = attention + ffn + 2 * 64  # + two RMSNorms                                    = 61,568
    n = 2 * block + 512 * 64 + 512 * 64 + 64  # blocks, embedding, output head, final norm = 188,736
    assert n == 188_736
    n_embedding = 512 * 64  # 32,768
    expected = 6 * (n - n_embedding) + 12 * 2 * 4 * 16 * 32  # 935,808 + 49,152 at seq_len 32
    assert expected == 984_960
    assert flops_per_token(args, 32) == pytest.approx(expected, rel=0, abs=0)
    # The analytic count is the real model's count (the callback builds it on meta).
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(args) == sum(p.numel() for p in model.parameters()) == n


def test_flops_per_token_llama3_8b():
    args = get_flavor("llama3_8b")
    n = 8_030_261_248
    n_embedding = 128256 * 4096
    expected = 6 * (n - n_embedding) + 12 * 32 * 32 * 128 * 8192  # layers, heads, head_dim, seq_len
    assert count_params(args) == n
    assert flops_per_token(args, 8192) == float(expected)
    assert flops_per_token(args, 8192, num_params=n) == float(expected)
    assert expected / 1e9 == pytest.approx(57.914, abs=0.001)  # ~58 GFLOPs per token


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
        ("", None),
    ],
)
def test_peak_bf16_tflops(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_per_device_numbers_are_layout_invariant():
    seq_len, global_batch, step_s, world, fpt = 2048, 8, 0.5, 4, 1e9
    # dp2 x tp2: each dp rank reads 4 sequences, tp peers read the same ones.
    dp2_tp2 = 4 * seq_len * 2
    # dp4: each rank reads 2 sequences.
    dp4 = 2 * seq_len * 4
    assert dp2_tp2 == dp4 == global_batch * seq_len
    a = per_device_throughput(dp2_tp2, step_s, world, fpt, peak_tflops=989.0)
    b = per_device_throughput(dp4, step_s, world, fpt, peak_tflops=989.0)
    assert a == b
    assert a["tokens_per_sec_per_device"] == global_batch * seq_len / step_s / world  # 8192 tok/s
    assert a["tflops_per_device"] == pytest.approx(8192 * 1e9 / 1e12)
    assert a["mfu"] == pytest.approx(8.192 / 989.0)
    # Scaling the per-rank count by the world size (Lightning's way) would count tp peers twice.
    assert 4 * seq_len * world / step_s / world != a["tokens_per_sec_per_device"]
    assert "mfu" not in per_device_throughput(dp4, step_s, world, fpt, peak_tflops=None)


def _fit(tmp_path: Path, max_steps: int, accumulate: int = 1) -> tuple[ThroughputMonitor, list[dict[str, str]]]:
    torch.manual_seed(0)
    batches = [torch.randint(0, 512, (8, 33)) for _ in range(max_steps * accumulate)]
    module = lit_titan.PretrainModule("llama3_debug", TINY)
    monitor = ThroughputMonitor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[monitor],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return monitor, rows


def _perf_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for r in rows if r.get("perf/tokens_per_sec_per_device")]


def test_fit_on_cpu_logs_throughput_without_mfu(tmp_path):
    monitor, rows = _fit(tmp_path, max_steps=4)
    perf = _perf_rows(rows)
    assert len(perf) == 3  # steps 2..4; the first step only starts the clock
    for r in perf:
        assert float(r["perf/tokens_per_sec_per_device"]) > 0
        assert float(r["perf/tflops_per_device"]) > 0
        assert r.get("train/loss")  # same row as the step's loss
    assert "perf/mfu" not in rows[0]  # CPU is not in the peak table: no column at all
    assert "perf/max_memory_allocated_gib" not in rows[0]
    last = monitor.last
    assert last["global_tokens"] == 8 * 32
    assert last["tokens_per_sec_per_device"] == pytest.approx(8 * 32 / last["step_seconds"])
    fpt = flops_per_token(get_flavor("llama3_debug", **TINY), 32)
    assert last["tflops_per_device"] == pytest.approx(last["tokens_per_sec_per_device"] * fpt / 1e12)
    assert "mfu" not in last


def test_logs_once_per_optimizer_step_with_accumulation(tmp_path):
    monitor, rows = _fit(tmp_path, max_steps=3, accumulate=2)
    perf = _perf_rows(rows)
    steps = [int(r["step"]) for r in perf]
    assert len(perf) == 2 and len(set(steps)) == 2  # 6 micro-batches, 3 optimizer steps, first skipped
    assert monitor.last["global_tokens"] == 8 * 32 * 2  # micro * seq_len * dp * accumulate
