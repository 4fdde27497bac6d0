"""Sharded checkpoint save (asynchronous by default) with atomic publish, and its load.

Protocol of one save (every rank calls :meth:`CheckpointWriter.save` at the same step):
1. rank 0 creates ``step-XXXXXX.partial/``; all ranks wait for it;
2. each rank writes its RNG state, rank 0 writes ``meta.pt`` (loop, scheduler, data-loader state);
3. DCP writes the model and optimizer shards, in a background thread when async: the state is
   first copied to CPU memory (``BlockingAsyncStager``; DCP's default stager does not copy
   tensors that already live on the CPU, so training would overwrite them mid-write), then training
   continues while the copy is written;
4. DCP's coordinator writes ``.metadata`` only after gathering every rank's write result, so when
   rank 0's save finishes, every rank has finished: rank 0 then renames the directory to
   ``step-XXXXXX`` (an atomic rename) and prunes old checkpoints.
A crash at any point leaves at most a ``.partial`` directory, which ``resume=auto`` ignores.
The background save runs its collectives on its own gloo group, so they never interleave with
training's collectives on the default group.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lit_titan.checkpoint.layout import (
    META_FILE,
    RNG_DIR,
    SafeFileSystemReader,
    partial_path,
    prune,
    rng_file,
    validate,
)

WriteHook = Callable[[Path], None]


class CheckpointWriter:
    """Owns the in-flight save of one training job; one save at a time."""

    def __init__(self, async_save: bool = True, keep_last: int = 0) -> None:
        self.async_save = async_save
        self.keep_last = keep_last
        # Called on every rank with the staging directory once its shards are being written
        # (fault drills kill a rank here; see lit_titan.callbacks.FaultInjection).
        self.on_write_started: list[WriteHook] = []
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None

    def save(self, state: dict[str, Any], meta: dict[str, Any], final: Path, *, rank: int, world_size: int,
             barrier: Callable[[], None]) -> None:
        """Start saving ``state`` (DTensor state dicts) and ``meta`` as checkpoint ``final``."""
        self.wait()
        staging = partial_path(final)
        if rank == 0:
            if final.exists():
                raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
            shutil.rmtree(staging, ignore_errors=True)  # an earlier attempt's unpublished save
            (staging / RNG_DIR).mkdir(parents=True)
        barrier()
        torch.save({**capture_rng(), "world_size": world_size}, rng_file(staging, rank))
        if rank == 0:
            torch.save(meta, staging / META_FILE)
        import torch.distributed.checkpoint as dcp

        if self.async_save and dist.is_initialized():
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            if self._group is None:  # collective: every rank reaches here at the same save
                self._group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, checkpoint_id=str(staging), process_group=self._group,
                                    async_stager=BlockingAsyncStager())
            future = getattr(future, "upload_completion", future)  # AsyncSaveResponse on newer torch
            self._run_hooks(staging)
            if rank == 0:
                future.add_done_callback(lambda f: self._publish(f, staging, final))
            self._pending = future
        else:
            dcp.save(state, checkpoint_id=str(staging))
            self._run_hooks(staging)
            if rank == 0:
                done: Future = Future()
                done.set_result(None)
                self._publish(done, staging, final)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written; a failed save is reported, not raised."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as err:  # training goes on; the save stays unpublished
            print(f"lit-titan: checkpoint save failed: {type(err).__name__}: {err}", file=sys.stderr)

    def _run_hooks(self, staging: Path) -> None:
        for hook in self.on_write_started:
            hook(staging)

    def _publish(self, future: Future, staging: Path, final: Path) -> None:
        if future.exception() is not None:
            return  # unpublished: resume=auto never sees it
        try:
            validate(staging, staged=True)
            staging.rename(final)
        except Exception as err:
            print(f"lit-titan: could not publish checkpoint {final}: {err}", file=sys.stderr)
            return
        _fsync_dir(final.parent)
        prune(final.parent, self.keep_last)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- RNG ----------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """This rank's generator states, as types ``torch.load(weights_only=True)`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- load ---------------------------------------------------------------------------------------
def load_sharded(model: nn.Module, optimizers: list[torch.optim.Optimizer], ckpt: Path, *, rank: int,
                 world_size: int) -> dict[str, Any]:
    """Load model and optimizer shards into the (already parallelised) ``model``, any layout.

    DCP reshards on load, so a checkpoint saved under one layout loads under another. RNG states
    are restored only under the same world size (there is no meaningful mapping otherwise; the
    model draws no random numbers in training). Returns ``meta.pt`` for Lightning to restore
    loops, schedulers, callbacks and the data-loader position.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from lit_titan.optim import keep_kernel_choice

    validate(ckpt)
    model_state = {"state_dict": get_model_state_dict(model)}
    dcp.load(model_state, storage_reader=SafeFileSystemReader(str(ckpt)))
    set_model_state_dict(model, model_state["state_dict"])
    for idx, optimizer in enumerate(optimizers):
        key = f"optimizer_{idx}"
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim_state, storage_reader=SafeFileSystemReader(str(ckpt)))
        keep_kernel_choice(optim_state[key], optimizer)  # fused/foreach: this process's, not the saver's
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key])
    meta = torch.load(ckpt / META_FILE, weights_only=True, map_location="cpu")
    rng_path = rng_file(ckpt, rank)
    if rng_path.is_file():
        rng = torch.load(rng_path, weights_only=True, map_location="cpu")
        if rng.get("world_size") == world_size:
            restore_rng(rng)
    return meta
