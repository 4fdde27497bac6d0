"""Per-device throughput, TFLOP/s, MFU and peak memory, logged at each logging step.

``ThroughputMonitor`` logs through ``pl_module.log(..., on_step=True, on_epoch=False)`` on the
steps that write a metrics row (``trainer.log_every_n_steps``), so the values land in the same
row (e.g. ``metrics.csv``) as ``train/loss`` of that step, averaged over the steps since the last:

- ``perf/tokens_per_sec_per_device``: global tokens of the window / its wall time / world size;
- ``perf/tflops_per_device``:         tokens_per_sec_per_device * flops_per_token / 1e12;
- ``perf/mfu``:                       tflops_per_device / peak bf16 dense TFLOP/s of the device,
  only on devices listed in ``PEAK_BF16_TFLOPS`` (never on CPU or unknown GPUs);
- ``perf/max_memory_allocated_gib`` / ``perf/max_memory_reserved_gib``: CUDA only.

Model FLOPs per token come from the model family (``lit_titan.models.registry.flops_per_token``;
Llama's formula: ``models/llama3/flops.py``).
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lit_titan.log_cadence import forget_logged, is_logging_step
from lit_titan.models.registry import count_params, flops_per_token
from lit_titan.strategies.contract import contract

__all__ = [
    "PEAK_BF16_TFLOPS",
    "ThroughputMonitor",
    "peak_bf16_tflops",
    "per_device_throughput",
]

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

_GIB = 1024**3


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


def per_device_throughput(global_tokens: float, step_seconds: float, world_size: int, flops_per_token: float,
                          peak_tflops: float | None = None) -> dict[str, float]:
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


class ThroughputMonitor(L.Callback):
    """Logs ``perf/*`` at logging steps (``trainer.log_every_n_steps``), averaged over the steps since the last.

    A window runs from the end of one logged optimizer step (or of warm-up) to the end of the next
    logged one; its time covers everything in between (data loading included; validation
    excluded: the clock restarts when validation ends). The logged numbers are the window's
    tokens / time (with ``log_every_n_steps=1``: each step's own). The first ``warmup_steps``
    steps (start-up, ``torch.compile``) only start the clock.

    No host sync on steps that do not log: on CUDA the window boundaries are CUDA events recorded
    on the current stream, and the elapsed time is read at the logging step (one
    ``Event.synchronize`` there, the step the loss is read anyway); on other devices the host clock
    is read at window boundaries only.

    MFU is always measured against the device's *bf16 dense* peak, also when training with
    Float8 matmuls (then MFU can exceed what bf16 could reach; it stays comparable across
    recipes). It is logged only on devices in ``PEAK_BF16_TFLOPS`` or with an explicit
    ``peak_tflops``; on CPU and unknown GPUs it is not logged at all.

    Args:
        warmup_steps: optimizer steps not measured (the clock starts at the end of the last one).
        log_memory: log CUDA peak allocated / reserved memory (GiB) per device.
        peak_tflops: peak dense bf16 TFLOP/s of the device, overriding the table lookup.
    """

    def __init__(self, warmup_steps: int = 1, log_memory: bool = True, peak_tflops: float | None = None) -> None:
        if warmup_steps < 1:
            raise ValueError("warmup_steps must be >= 1: the first step has no previous step end to time from")
        self.warmup_steps = warmup_steps
        self.log_memory = log_memory
        self.peak_tflops_override = peak_tflops
        self.last: dict[str, float] = {}
        self.num_params: int | None = None
        self.peak_tflops: float | None = None
        self._start: _Mark | None = None  # the window's start (None: clock not running)
        self._steps_seen = 0
        self._prev_global_step = 0
        self._window_tokens = 0  # this rank's input tokens since the window started
        self._window_steps = 0
        self._seq_len = 0

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.num_params = _whole_model_params(pl_module)
        device = pl_module.device
        if self.peak_tflops_override is not None:
            self.peak_tflops = float(self.peak_tflops_override)
        elif device.type == "cuda":
            self.peak_tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
        else:
            self.peak_tflops = None
        self._start, self._steps_seen = None, 0
        self._prev_global_step = trainer.global_step
        self._window_tokens = self._window_steps = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        forget_logged(trainer, "perf/")  # logged at the previous logging step; its row is written

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        tokens = _batch_tokens(batch)  # shapes only: no device access
        if tokens is not None:
            self._window_tokens += tokens[0] * tokens[1]
            self._seq_len = tokens[1]
        if trainer.global_step == self._prev_global_step:
            return  # inside an accumulation window: no optimizer step yet
        self._prev_global_step = trainer.global_step
        self._steps_seen += 1
        if self._steps_seen <= self.warmup_steps or self._start is None:
            self._restart(pl_module.device)
            return
        self._window_steps += 1
        if not is_logging_step(trainer, trainer.global_step):
            return  # nothing read, nothing logged: no host sync on this step
        start, end = self._start, _Mark.now(pl_module.device)
        window_tokens, window_steps = self._window_tokens, self._window_steps
        self._start, self._window_tokens, self._window_steps = end, 0, 0
        if not window_tokens:
            return
        seconds = start.seconds_until(end)  # on CUDA: waits for the GPU to reach the step's end

        # Global tokens of the window: this rank's (micro * seq_len per micro-batch, summed over the
        # accumulation windows) times the data-parallel size; tp/cp/pp peers see the same batch.
        dp = contract(trainer.strategy).data_parallel_size
        global_tokens = window_tokens * dp
        # Per device: global tokens / world size. Lightning's ThroughputMonitor multiplies the
        # per-rank count by the world size and so over-counts TP/CP/PP peers that process the
        # same tokens; dividing the *global* count by the world size gives the same per-device
        # numbers for the same per-device work under any layout.
        model_args = getattr(pl_module, "model_args", None)
        fpt = flops_per_token(model_args, self._seq_len, self.num_params) if model_args is not None else 0.0
        values = per_device_throughput(global_tokens, seconds, trainer.world_size, fpt, self.peak_tflops)
        if model_args is None:
            values.pop("tflops_per_device")
            values.pop("mfu", None)
        if self.log_memory and pl_module.device.type == "cuda":
            values["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / _GIB
            values["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(pl_module.device) / _GIB
        # per-step means over the window
        self.last = {**values, "step_seconds": seconds / window_steps, "global_tokens": global_tokens / window_steps,
                     "window_steps": float(window_steps)}
        for key, value in values.items():
            pl_module.log(f"perf/{key}", float(value), on_step=True, on_epoch=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation inside fit runs right after a step end: restart the clock so it isn't counted.
        if self._start is not None:  # None before training / during the sanity check
            self._restart(pl_module.device)

    # ---- helpers --------------------------------------------------------------------------------
    def _restart(self, device: torch.device) -> None:
        self._start, self._window_tokens, self._window_steps = _Mark.now(device), 0, 0


class _Mark:
    """A point in the step stream: a CUDA event recorded on the current stream, or the host clock."""

    __slots__ = ("event", "host")

    def __init__(self, event: Any = None, host: float | None = None) -> None:
        self.event, self.host = event, host

    @classmethod
    def now(cls, device: torch.device) -> _Mark:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))  # queued: no wait
            return cls(event=event)
        return cls(host=time.perf_counter())

    def seconds_until(self, end: _Mark) -> float:
        if self.event is not None and end.event is not None:
            end.event.synchronize()  # the one host wait, on logging steps only
            return self.event.elapsed_time(end.event) / 1e3  # ms -> s
        assert self.host is not None and end.host is not None
        return end.host - self.host


def _batch_tokens(batch: Any) -> tuple[int, int] | None:
    """(micro-batch size, seq_len) of a [micro, seq_len + 1] token batch (or its first tensor)."""
    if isinstance(batch, dict):
        batch = next((v for v in batch.values() if isinstance(v, Tensor)), None)
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    if not isinstance(batch, Tensor) or batch.dim() < 2:
        return None
    return int(batch.shape[0]), int(batch.shape[1]) - 1


def _whole_model_params(pl_module: L.LightningModule) -> int | None:
    """Parameters of the whole model (not this rank's shard or stage), built once on meta."""
    build = getattr(pl_module, "build_model", None)
    if callable(build):
        try:
            with torch.device("meta"):
                model: nn.Module = build()
            return sum(p.numel() for p in model.parameters())
        except Exception:  # fall back to the analytic count from model_args
            pass
    model_args = getattr(pl_module, "model_args", None)
    return count_params(model_args) if model_args is not None else None
