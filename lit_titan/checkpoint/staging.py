"""Staging a checkpoint: one copy of the rank's state into CPU buffers allocated once, reused by every save.

An asynchronous save must first copy the state somewhere training will not overwrite while the
background thread writes it. That copy is all the training loop waits for, so it has to be one
copy at memory bandwidth: no allocation after the first save (fresh CPU memory costs page faults,
fresh pinned memory costs ~0.5 s per GB to register), and on CUDA device-to-host copies into
*pinned* buffers issued ``non_blocking`` and waited for once (unpinned copies are synchronous and
~30x slower). At 8B scale that is a fraction of a second per save against seconds to tens of
seconds for a plain ``.to("cpu")`` or DCP's ``BlockingAsyncStager`` (a new copy per save):
docs/benchmarks.md, "Figures quoted in code before".

Why not DCP's own stager: ``DefaultStager`` (pinned, cached) is the intended tool, but on torch
2.11 its second use fails (``KeyError: <class 'type'>`` in ``_state_dict_stager``'s deepcopy), and
``BlockingAsyncStager(cache_staged_state_dict=True)`` pins unconditionally (fails without CUDA) and
goes through private helpers whose behaviour changed across 2.11-2.15. The stager below uses only
tensor copies, plus DTensor's own constructor to rebuild each DTensor around its CPU buffer (as
torch's ``DTensor.to("cpu")`` does internally), so DCP writes exactly the sharded layout it would
have written from the live state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

Path_ = tuple[Any, ...]


def local_tensors(state: Any, prefix: Path_ = ()) -> Iterator[tuple[Path_, torch.Tensor]]:
    """Every tensor of a (nested) state dict with its key path; a DTensor yields its local shard."""
    if isinstance(state, DTensor):
        yield prefix, state.to_local()
    elif isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from local_tensors(value, (*prefix, key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from local_tensors(value, (*prefix, i))


def local_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in ``state`` (what one checkpoint of it writes, before file overhead)."""
    return sum(t.numel() * t.element_size() for _, t in local_tensors(state))


class PinnedStager(AsyncStager):
    """DCP ``AsyncStager`` that copies the state into buffers kept for the life of the job.

    Buffers are keyed by their path in the state dict and reallocated only when a tensor's shape
    or dtype changes (the first save, or a changed state). They are pinned when the source lives
    on CUDA (pinning needs CUDA and only helps device-to-host copies). The caller must not stage
    again before the previous save finished writing the buffers (``CheckpointWriter`` waits for it).
    """

    # stage() returns a fully copied state: DCP need not call synchronize_staging().
    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[Path_, torch.Tensor] = {}
        self.allocated_bytes = 0  # allocated by the latest stage() call (0 once warm)
        self.last_stage_s = 0.0
        self.last_bytes = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        self.allocated_bytes = self.last_bytes = 0
        buffers: dict[Path_, torch.Tensor] = {}
        devices: set[torch.device] = set()
        with torch.no_grad():
            staged = self._stage(state_dict, (), buffers, devices)
        for device in devices:  # one wait per device for all the non_blocking copies
            torch.cuda.current_stream(device).synchronize()
        self._buffers = buffers  # drops buffers of keys that disappeared
        self.last_stage_s = time.perf_counter() - start
        return staged

    def _stage(self, obj: Any, path: Path_, buffers: dict[Path_, torch.Tensor], devices: set[torch.device]) -> Any:
        if isinstance(obj, DTensor):
            # The spec (mesh, placements, global shape) is immutable metadata: share it.
            return DTensor(self._copy(obj.to_local(), path, buffers, devices), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, path, buffers, devices)
        if isinstance(obj, dict):
            return {k: self._stage(v, (*path, k), buffers, devices) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._stage(v, (*path, i), buffers, devices) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._stage(v, (*path, i), buffers, devices) for i, v in enumerate(obj))
        return obj  # ints, floats, strings: immutable

    def _copy(
        self, src: torch.Tensor, path: Path_, buffers: dict[Path_, torch.Tensor], devices: set[torch.device]
    ) -> torch.Tensor:
        on_cuda = src.device.type == "cuda"
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=on_cuda)
            self.allocated_bytes += buf.numel() * buf.element_size()
        buf.copy_(src.detach(), non_blocking=on_cuda)
        if on_cuda:
            devices.add(src.device)
        buffers[path] = buf
        self.last_bytes += buf.numel() * buf.element_size()
        return buf

    def close(self) -> None:
        self._buffers = {}
