"""Per-device throughput, TFLOP/s, MFU and peak memory, logged at each logging step.

``ThroughputMonitor`` logs through ``pl_module.log(..., on_step=True, on_epoch=False)`` on the
steps that write a metrics row (``trainer.log_every_n_steps``), so the values land in the same
row (e.g. ``metrics.csv``) as ``train/loss`` of that step, averaged over the steps since the last:
``perf/tokens_per_sec_per_device``, ``perf/tflops_per_device``, ``perf/mfu`` (only on devices
with a known peak: never on CPU or unknown GPUs) and, on CUDA, ``perf/max_memory_allocated_gib`` /
``perf/max_memory_reserved_gib``. The maths is ``lit_titan.observe.throughput``; the model's FLOPs
per token the model family's (``lit_titan.models.registry.flops_per_token``). This file only hooks them into Lightning.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from lit_titan.callbacks.settings import ThroughputConfig
from lit_titan.models.registry import count_params, flops_per_token
from lit_titan.observe.log_cadence import forget_logged, is_logging_step
from lit_titan.observe.throughput import Mark, batch_tokens, peak_bf16_tflops, per_device_throughput
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import contract, module_contract

__all__ = ["ThroughputMonitor"]

_GIB = 1024**3


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

    Takes a ``ThroughputConfig`` (``callbacks/settings.py``) or its fields by name:
        warmup_steps: optimizer steps not measured (the clock starts at the end of the last one).
        log_memory: log CUDA peak allocated / reserved memory (GiB) per device.
        peak_tflops: peak dense bf16 TFLOP/s of the device, overriding the table lookup.
    """

    def __init__(self, settings: ThroughputConfig | None = None, **keys: Any) -> None:
        s = self.settings = settings_of(ThroughputConfig, settings, keys)
        if s.warmup_steps < 1:
            raise ValueError("warmup_steps must be >= 1: the first step has no previous step end to time from")
        self.warmup_steps = s.warmup_steps
        self.log_memory = s.log_memory
        self.peak_tflops_override = s.peak_tflops
        self.last: dict[str, float] = {}
        self.num_params: int | None = None
        self.peak_tflops: float | None = None
        self._start: Mark | None = None  # the window's start (None: clock not running)
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

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        forget_logged(trainer, "perf/")  # logged at the previous logging step; its row is written

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = batch_tokens(batch)  # shapes only: no device access
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
        start, end = self._start, Mark.now(pl_module.device)
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
        # numbers for the same per-device work under any layout. Under replica-group fault
        # tolerance Lightning's world is one group: the divisor is the job's live ranks.
        model_args = module_contract(pl_module).model_args
        fpt = flops_per_token(model_args, self._seq_len, self.num_params) if model_args is not None else 0.0
        devices = contract(trainer.strategy).training_devices
        values = per_device_throughput(global_tokens, seconds, devices, fpt, self.peak_tflops)
        if model_args is None:
            values.pop("tflops_per_device")
            values.pop("mfu", None)
        if self.log_memory and pl_module.device.type == "cuda":
            values["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / _GIB
            values["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(pl_module.device) / _GIB
        # per-step means over the window
        self.last = {
            **values,
            "step_seconds": seconds / window_steps,
            "global_tokens": global_tokens / window_steps,
            "window_steps": float(window_steps),
        }
        for key, value in values.items():
            pl_module.log(f"perf/{key}", float(value), on_step=True, on_epoch=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation inside fit runs right after a step end: restart the clock so it isn't counted.
        if self._start is not None:  # None before training / during the sanity check
            self._restart(pl_module.device)

    # ---- helpers --------------------------------------------------------------------------------
    def _restart(self, device: torch.device) -> None:
        self._start, self._window_tokens, self._window_steps = Mark.now(device), 0, 0


def _whole_model_params(pl_module: L.LightningModule) -> int | None:
    """Parameters of the whole model (not this rank's shard or stage), built once on meta."""
    module = module_contract(pl_module)
    if module.model_args is None:  # not a PretrainModule: nothing to count from
        return None
    try:
        with torch.device("meta"):
            model: nn.Module = module.build_model()
        return sum(p.numel() for p in model.parameters())
    except Exception:  # fall back to the analytic count from model_args
        return count_params(module.model_args)
