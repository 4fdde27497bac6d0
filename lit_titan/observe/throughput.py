"""Throughput maths of a step, independent of the model: per-device tokens/s, TFLOP/s, MFU, peak tables.

Per device, from a step's *global* token count (``per_device_throughput``):

- ``tokens_per_sec_per_device``: global tokens / wall time / world size;
- ``tflops_per_device``:         tokens_per_sec_per_device * flops_per_token / 1e12;
- ``mfu``:                       tflops_per_device / peak bf16 dense TFLOP/s of the device, only where
  the peak is known (``PEAK_BF16_TFLOPS``, or a cluster profile's figure: ``peak_flops``).

The model's FLOPs per token come from its family (``lit_titan.models.llama3.flops``);
``lit_titan.callbacks.throughput.ThroughputMonitor`` logs these numbers during training and the
planner uses the same peaks for its step-time model.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

__all__ = ["PEAK_BF16_TFLOPS", "Mark", "batch_tokens", "peak_bf16_tflops", "peak_flops", "per_device_throughput"]

# Peak dense (no structured sparsity) BF16 Tensor Core TFLOP/s, matched as case-insensitive
# substrings of ``torch.cuda.get_device_name()``; the first match wins, so the specific names come
# before the generic ones ("H100 PCIe" / "H100 NVL" before "H100", "H200 NVL" before "H200").
# Sources: NVIDIA datasheets, which quote BF16 "with sparsity"; the dense figure is half of it.
# - A100 datasheet: BF16 312 TFLOPS dense (624 sparse), SXM4 and PCIe alike.
# - H100 datasheet: BF16 1,979 (SXM) / 1,513 (PCIe) / 1,671 (NVL) TFLOPS with sparsity
#   -> 989 / 756 / 835 dense. "NVIDIA H100 80GB HBM3" is the SXM part.
# - H200 datasheet: BF16 1,979 (SXM) / 1,671 (NVL) TFLOPS with sparsity -> 989 / 835 dense
#   (GH200's GPU is the same H100/H200 silicon: its name "GH200" matches "H200", 989).
# - B200 (HGX B200 datasheet): BF16 4.5 PFLOPS with sparsity -> 2,250 dense.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100 SXM", 989.0),
    ("H100", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("B200", 2250.0),
)


def peak_flops(cluster: dict[str, Any], precision: str) -> float:
    """Peak FLOP/s per device of a cluster profile (``conf/cluster``) for the run's matmul dtype: ``peak_fp32_tflops`` under 32-true when the
    profile has it (CPU profiles measure it), else ``peak_bf16_tflops``."""
    if precision == "32-true" and cluster.get("peak_fp32_tflops"):
        return float(cluster["peak_fp32_tflops"]) * 1e12
    return float(cluster.get("peak_bf16_tflops") or 0) * 1e12


def peak_bf16_tflops(device_name: str | None) -> float | None:
    """Peak dense BF16 TFLOP/s of a GPU from its ``torch.cuda.get_device_name()``; None if unknown."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in name:
            return tflops
    return None


def per_device_throughput(
    global_tokens: float, step_seconds: float, world_size: int, flops_per_token: float, peak_tflops: float | None = None
) -> dict[str, float]:
    """Per-device numbers of one optimizer step from its *global* token count.

    The global tokens are divided by the world size (every rank: dp, tp, cp and pp peers alike),
    so the same per-device work gives the same per-device numbers under any parallel layout.
    ``mfu`` is present only when ``peak_tflops`` is known.
    """
    tokens_per_sec = global_tokens / step_seconds / world_size
    tflops = tokens_per_sec * flops_per_token / 1e12
    out = {"tokens_per_sec_per_device": tokens_per_sec, "tflops_per_device": tflops}
    if peak_tflops:
        out["mfu"] = tflops / peak_tflops
    return out


class Mark:
    """A point in the step stream: a CUDA event recorded on the current stream, or the host clock."""

    __slots__ = ("event", "host")

    def __init__(self, event: Any = None, host: float | None = None) -> None:
        self.event, self.host = event, host

    @classmethod
    def now(cls, device: torch.device) -> Mark:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))  # queued: no wait
            return cls(event=event)
        return cls(host=time.perf_counter())

    def seconds_until(self, end: Mark) -> float:
        if self.event is not None and end.event is not None:
            end.event.synchronize()  # the one host wait, on logging steps only
            return self.event.elapsed_time(end.event) / 1e3  # ms -> s
        assert self.host is not None and end.host is not None
        return end.host - self.host


def batch_tokens(batch: Any) -> tuple[int, int] | None:
    """(micro-batch size, seq_len) of a [micro, seq_len + 1] token batch (or its first tensor)."""
    if isinstance(batch, dict):
        batch = next((v for v in batch.values() if isinstance(v, Tensor)), None)
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    if not isinstance(batch, Tensor) or batch.dim() < 2:
        return None
    return int(batch.shape[0]), int(batch.shape[1]) - 1
