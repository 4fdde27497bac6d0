"""Sharded checkpoint save (asynchronous by default) with atomic publish, and its load.

Protocol of one save (every rank calls :meth:`CheckpointWriter.save` at the same step):
1. the previous save is waited for; if it failed on any rank, every rank raises (below);
2. the ranks sum their state bytes; rank 0 checks the free space, counting the oldest complete
   checkpoints that it will prune *before* writing (``disk.py``: peak ``keep_last`` checkpoints;
   deleted by the writing thread before any rank writes a shard, and only once every rank found the
   state it writes finite: ``finite.py``), and creates
   ``step-XXXXXX.partial/``; every rank learns rank 0's verdict;
3. each rank writes its RNG state, rank 0 writes ``meta.pt`` (loop, scheduler, data-loader state);
4. the state is copied once into CPU buffers allocated at the first save and reused
   (:class:`~lit_titan.checkpoint.staging.PinnedStager`; pinned, ``non_blocking`` on CUDA): that
   copy is all the training loop waits for. DCP then writes the shards from a background thread
   while training continues;
5. each rank's writing thread, after writing its shards, records a CRC-32 of each file it wrote
   (``checksums/rank-XXXXX.json``); DCP's coordinator writes ``.metadata`` only after gathering
   every rank's write result, so when rank 0's save finishes, every rank has finished: rank 0 then
   merges the records into ``checksums.json``, renames the directory to ``step-XXXXXX`` (an
   atomic rename) and prunes old checkpoints.
A crash at any point leaves at most a ``.partial`` directory, which ``resume=auto`` ignores.

Failures never hang the other ranks and never cost the previous checkpoint: every step that can
fail on one rank (steps 2, 3 and the write itself, whose errors DCP already gathers to all ranks)
ends in a collective agreement, after which every rank raises the same one-line
:class:`~lit_titan.checkpoint.CheckpointError` (exit code 2 from the command line) and rank 0
removes the unpublished ``.partial`` directory. A background write's failure is raised at the
next save or at the end of training, whichever comes first.

All checkpoint collectives run on the writer's own gloo group, created once on every rank: the
background write never interleaves with training's collectives, and DCP's async save, which needs
a CPU-capable group, works whatever the default backend is (NCCL on GPUs; no
``cpu:gloo,cuda:nccl`` default group is needed).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from lit_titan.checkpoint import disk
from lit_titan.checkpoint.finite import first_nonfinite
from lit_titan.checkpoint.layout import (
    META_FILE,
    RNG_DIR,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    checkpoint_step,
    merge_checksums,
    partial_path,
    prune,
    published,
    rng_file,
    validate,
    write_checksums,
)
from lit_titan.checkpoint.staging import PinnedStager, local_bytes, local_tensors
from lit_titan.errors import NonFiniteError, is_peer_failure, one_line

WriteHook = Callable[[Path], None]
# DCP raises CheckpointException, a BaseException (not an Exception) subclass, for a failed write.
_SAVE_ERRORS = (Exception, CheckpointException)


@dataclass
class SaveRecord:
    """Timings of one save on this rank (benchmarks/checkpoint_stall.py prints them)."""

    name: str
    local_bytes: int  # this rank's tensor bytes
    total_bytes: int  # all ranks' tensor bytes
    allocated_bytes: int  # staging buffers allocated by this save (the first one allocates them all)
    stage_s: float  # the copy into the staging buffers
    save_s: float  # time in CheckpointWriter.save: what the training loop waits for, once the previous save is done
    prepare_s: float = 0.0  # of save_s: sizes, free-space check and pruning, RNG and meta files, agreements
    blocked_s: float | None = None  # the whole trainer.save_checkpoint (set by the Checkpointing callback)
    complete_s: float | None = None  # from the start of save() until written (rank 0: and published)


class _FileSystemWriter(FileSystemWriter):
    """DCP's file writer, with work done in the writing thread: each rank checks that the state it
    writes is finite in its local plan; ``prune`` (the checkpoints that make room for this one,
    rank 0's) in the global plan, which DCP's coordinator runs only once every rank's local plan
    succeeded, so before any rank writes and never for a non-finite state; ``hooks`` just before
    this rank writes its shards; after them, the CRC-32 of every file this rank wrote (also off the
    training loop: in an async save this is the background thread, and DCP gathers its errors like
    a write error)."""

    def __init__(
        self, path: Path, hooks: list[WriteHook], prune: list[Path], state: dict[str, Any] | None = None, rank: int = 0
    ) -> None:
        super().__init__(str(path))
        self._staging, self._hooks, self._prune = path, list(hooks), list(prune)
        self._state, self._rank = state, rank

    def prepare_local_plan(self, plan: Any) -> Any:
        # here, off the training thread for an asynchronous save (its staged copy): lit_titan/checkpoint/finite.py
        bad = first_nonfinite(self._state) if self._state is not None else None
        self._state = None
        if bad:
            raise NonFiniteError(_nonfinite_message(self._staging, bad, self._rank))
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        disk.remove(self._prune)  # deleting GBs of files takes seconds on some filesystems: not in the training loop
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        for hook in self._hooks:  # fault drills raise OSError(ENOSPC) here, as a full disk would
            hook(self._staging)
        written = super().write_data(plan, planner)
        files = {self._staging / str(result.storage_data.relative_path) for result in written.wait()}
        files.add(rng_file(self._staging, self._rank))
        if (self._staging / META_FILE).is_file() and self._rank == 0:
            files.add(self._staging / META_FILE)
        write_checksums(self._staging, self._rank, sorted(files))
        return written


class _AlreadyStaged(AsyncStager):
    """DCP stager for a state that :class:`PinnedStager` has already copied (see ``save``)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


@dataclass
class _Pending:
    finished: Future  # done when written (rank 0: and published); its exception is the save's failure
    staging: Path
    final: Path
    need: int  # bytes on disk this checkpoint needs (for the error message)
    record: SaveRecord


class CheckpointWriter:
    """Owns the in-flight save of one training job; one save at a time."""

    def __init__(self, async_save: bool = True, keep_last: int = 0) -> None:
        self.async_save = async_save
        self.keep_last = keep_last
        # Called on every rank with the staging directory once its shards are being written
        # (fault drills kill a rank here; see lit_titan.callbacks.FaultInjection).
        self.on_write_started: list[WriteHook] = []
        # Called in the writing thread of every rank just before it writes its shards (I/O-error drills).
        self.on_write_data: list[WriteHook] = []
        # Called on every rank just before it stages its state (staging-error drills).
        self.on_stage: list[WriteHook] = []
        self.records: list[SaveRecord] = []
        self._group: dist.ProcessGroup | None = None
        self._stager = PinnedStager()
        self._pending: _Pending | None = None

    # ---- collectives (all on the writer's gloo group) ---------------------------------------
    def process_group(self) -> dist.ProcessGroup | None:
        """The gloo group of every checkpoint collective; the first call is collective (every rank)."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _gather(self, value: Any) -> list[Any]:
        group = self.process_group()
        if group is None or dist.get_world_size(group) == 1:
            return [value]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out

    def _agree(
        self, error: str | None, *, rank: int, cleanup: Path | None = None, kind: type[Exception] = CheckpointError
    ) -> None:
        """Collective: if any rank has an error, every rank raises the first one (rank 0 removes ``cleanup``)."""
        failed = [e for e in self._gather(error) if e]
        if failed:
            if rank == 0 and cleanup is not None:
                shutil.rmtree(cleanup, ignore_errors=True)
            error = kind(failed[0])
            error.raised_on_every_rank = True  # the command line prints it once (rank 0)
            raise error

    # ---- preflight ------------------------------------------------------------------------------
    def preflight(
        self,
        directory: Path,
        state: tuple[int, int],
        *,
        rank: int,
        world_size: int,
        every_n_steps: int,
        n_saves: int | None,
    ) -> None:
        """Collective, before training: stop on every rank if this run's checkpoints cannot fit on disk.

        ``state``: this rank's (tensor bytes, tensor count) per checkpoint (``disk.expected_state``).
        """
        total, count = (sum(x) for x in zip(*self._gather(tuple(state))))
        error = None
        if rank == 0:
            try:
                error = disk.preflight_error(
                    directory,
                    disk.checkpoint_disk_bytes(total, count, world_size),
                    total,
                    world_size,
                    self.keep_last,
                    every_n_steps,
                    n_saves,
                )
            except OSError as err:
                error = (
                    f"cannot check free space for checkpoints in {directory}: {one_line(err, with_type=True)}; "
                    "set run_dir"
                )
        self._agree(error, rank=rank)

    # ---- save -----------------------------------------------------------------------------------
    def save(
        self,
        state: dict[str, Any],
        meta: dict[str, Any],
        final: Path,
        *,
        rank: int,
        world_size: int,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        """Start saving ``state`` (DTensor state dicts) and ``meta`` as checkpoint ``final``.

        Returns once the state is staged (async) or written (sync); raises :class:`CheckpointError`
        on every rank when the previous save failed or this one cannot be started.
        ``barrier`` is unused (kept for callers of the earlier signature): the agreements below synchronise.
        """
        self.wait()
        start = time.perf_counter()
        staging = partial_path(final)
        mine = local_bytes(state)
        total, count = (sum(x) for x in zip(*self._gather((mine, sum(1 for _ in local_tensors(state))))))
        need = disk.checkpoint_disk_bytes(total, count, world_size)
        error, to_prune = None, []
        if rank == 0:
            try:
                if final.exists() and checkpoint_step(final) is not None:
                    raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
                plan = disk.plan_save(final.parent, final.name, need, self.keep_last)
                error = plan.error
                if error is None:
                    to_prune = [p for p in plan.prune if p != staging]  # deleted by the writing thread, first
                    shutil.rmtree(staging, ignore_errors=True)  # an earlier attempt's unpublished save
                    (staging / RNG_DIR).mkdir(parents=True)
            except (OSError, CheckpointError) as err:
                error = self._failure(err, final, need, "could not be started")
        self._agree(error, rank=rank, cleanup=staging)
        error = None
        try:
            torch.save({**capture_rng(), "world_size": world_size}, rng_file(staging, rank))
            if rank == 0:
                torch.save(meta, staging / META_FILE)
        except Exception as err:  # OSError, or torch.save's RuntimeError on a full disk
            error = self._failure(err, final, need, "could not be written", rank=rank)
        self._agree(error, rank=rank, cleanup=staging)

        prepared = time.perf_counter()
        import torch.distributed.checkpoint as dcp

        writer = _FileSystemWriter(staging, self.on_write_data, to_prune, rank=rank)
        group = self.process_group()
        record = SaveRecord(final.name, mine, total, 0, 0.0, 0.0, prepare_s=prepared - start)
        finished: Future = Future()
        if self.async_save and group is not None:
            # Staged here, not inside dcp.async_save, so that a rank whose copy fails (host memory
            # exhausted, say) tells the others at once instead of leaving them in DCP's planning
            # collectives until the process-group timeout.
            error, staged = None, None
            try:
                for hook in self.on_stage:
                    hook(staging)
                staged = self._stager.stage(state)
            except Exception as err:  # MemoryError, RuntimeError (pinning), OSError
                error = self._stage_failure(err, final, mine, rank)
            self._agree(error, rank=rank, cleanup=staging)
            writer._state = staged  # checked for NaN/Inf in the writing thread, before anything is pruned
            upload = dcp.async_save(staged, storage_writer=writer, process_group=group, async_stager=_AlreadyStaged())
            upload = getattr(upload, "upload_completion", upload)  # AsyncSaveResponse on newer torch
            record.stage_s, record.allocated_bytes = self._stager.last_stage_s, self._stager.allocated_bytes
        else:
            upload = Future()
            try:
                writer._state = state
                upload.set_result(dcp.save(state, storage_writer=writer, process_group=group))
            except _SAVE_ERRORS as err:
                upload.set_exception(err)
        upload.add_done_callback(lambda f: self._finish(f, finished, staging, final, rank, record, start))
        self._pending = _Pending(finished, staging, final, need, record)
        self.records.append(record)
        record.save_s = time.perf_counter() - start
        self._run_hooks(staging)
        if not (self.async_save and group is not None):
            self.wait()

    def wait(self, *, agree: bool = True) -> None:
        """Block until the in-flight save (if any) is written and published.

        ``agree`` (collective, every rank): a failure on any rank raises :class:`CheckpointError`
        on every rank. Without it (teardown after another error) a failure is only reported.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error, err = None, None
        try:
            pending.finished.result()
        except _SAVE_ERRORS as caught:
            error, err = self._failure(caught, pending.final, pending.need, "could not be written"), caught
        if agree:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            refused = err is not None and isinstance(_root_cause(err)[1], NonFiniteError)  # DCP told every rank
            self._agree(
                str(_root_cause(err)[1]) if refused else error,
                rank=rank,
                cleanup=pending.staging,
                kind=NonFiniteError if refused else CheckpointError,
            )
        elif error and not is_peer_failure(_root_cause(err)[1]):  # a dead peer: the command line's one line says it
            print(f"lit-titan: {error}", file=sys.stderr)

    def _finish(
        self, upload: Future, finished: Future, staging: Path, final: Path, rank: int, record: SaveRecord, start: float
    ) -> None:
        """Runs when this rank's write is done (in the writing thread): rank 0 publishes."""
        try:
            upload.result()
            if rank == 0:
                self._publish(staging, final)
            record.complete_s = time.perf_counter() - start
            finished.set_result(None)
        except BaseException as err:  # noqa: BLE001 - handed to wait(), which raises on every rank
            finished.set_exception(err)

    def _failure(self, err: BaseException, final: Path, need: int, what: str, rank: int | None = None) -> str:
        """One line: what failed, why, the disk state, the checkpoint kept and the settings to change."""
        failed_rank, cause = _root_cause(err)
        who = failed_rank if failed_rank is not None else rank
        where = f" on rank {who}" if who is not None else ""
        previous = published(final.parent)
        kept = f"the previous complete checkpoint {previous[-1].name} is kept" if previous else "no earlier checkpoint"
        if is_peer_failure(cause):  # a rank's process ended: not a disk problem
            return f"checkpoint {final.name} {what}: a peer rank's process ended during the save; {kept}"
        try:
            free_bytes = disk.free_bytes(final.parent)
            free = f"{disk.fmt(free_bytes)} free in {final.parent}"
        except OSError:
            free_bytes, free = None, f"free space in {final.parent} unknown"
        # the disk's advice only for a disk error (or a write error with less free space than the checkpoint needs:
        # torch.save's RuntimeError on a full disk carries no errno)
        disk_full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
            not isinstance(cause, OSError) and free_bytes is not None and free_bytes < need
        )
        failed = f"checkpoint {final.name} {what}{where} ({one_line(cause, with_type=True)})"
        if not disk_full:
            return f"{failed}; {kept}"
        return f"{failed}; it needs {disk.fmt(need)}, {free}; {kept}; {disk.SETTINGS_HINT}"

    @staticmethod
    def _stage_failure(err: BaseException, final: Path, mine: int, rank: int) -> str:
        """One line for a failed copy into host memory: nothing was written, the disk is not the cause."""
        previous = published(final.parent)
        kept = f"the previous complete checkpoint {previous[-1].name} is kept" if previous else "no earlier checkpoint"
        return (
            f"checkpoint {final.name} could not be staged on rank {rank} ({one_line(err, with_type=True)}); "
            f"its copy of the state needs {disk.fmt(mine)} of host memory; {kept}; free host memory on that node "
            "or set checkpoint.async_save=false (writes from the live state, no copy)"
        )

    def _run_hooks(self, staging: Path) -> None:
        for hook in self.on_write_started:
            hook(staging)

    def _publish(self, staging: Path, final: Path) -> None:
        try:
            merge_checksums(staging)
            validate(staging, staged=True)
        except CheckpointError as err:
            raise CheckpointError(f"the written checkpoint failed validation: {err}") from None
        replaced = _set_aside(final)
        staging.rename(final)
        _fsync_dir(final.parent)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        prune(final.parent, self.keep_last)


def _set_aside(final: Path) -> Path | None:
    """A name that is not a step's (Lightning's ``last.ckpt``, a path given to ``trainer.save_checkpoint``) is
    overwritten, as Lightning overwrites its files: the old checkpoint is renamed aside until the new one is in
    place, so a crash between the two renames leaves it on disk (``<name>.replaced``), never neither."""
    if not final.exists():
        return None
    aside = final.with_name(final.name + ".replaced")
    shutil.rmtree(aside, ignore_errors=True)
    final.rename(aside)
    return aside


def _nonfinite_message(staging: Path, key: str, rank: int) -> str:
    final = staging.name.removesuffix(".partial")
    previous = published(staging.parent)
    kept = f"every complete checkpoint is kept (newest {previous[-1].name})" if previous else "no earlier checkpoint"
    return (
        f"checkpoint {final} not written: the state is not finite ({key} holds NaN/Inf on rank {rank}); nothing "
        f"was pruned, {kept}; resume=auto from it with a lower optim.lr, and keep nonfinite.enabled=true"
    )


def _root_cause(err: BaseException) -> tuple[int | None, BaseException]:
    """The original exception inside DCP's ``CheckpointException`` (which lists every rank's traceback)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(cause, BaseException):
            return rank, cause
    return None, err


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
def load_sharded(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], ckpt: Path, *, rank: int, world_size: int
) -> dict[str, Any]:
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

    from lit_titan.optim.build import keep_kernel_choice

    validate(ckpt)  # cheap checks; the checksums were verified once, before the processes started
    model_state = {"state_dict": get_model_state_dict(model)}
    _load(dcp, model_state, ckpt)
    set_model_state_dict(model, model_state["state_dict"])
    for idx, optimizer in enumerate(optimizers):
        key = f"optimizer_{idx}"
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        _load(dcp, optim_state, ckpt)
        keep_kernel_choice(optim_state[key], optimizer)  # fused/foreach: this process's, not the saver's
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key])
    meta = torch.load(ckpt / META_FILE, weights_only=True, map_location="cpu")
    rng_path = rng_file(ckpt, rank)
    if rng_path.is_file():
        rng = torch.load(rng_path, weights_only=True, map_location="cpu")
        if rng.get("world_size") == world_size:
            restore_rng(rng)
    return meta


def _load(dcp: Any, state: dict[str, Any], ckpt: Path) -> None:
    """``dcp.load`` through the safe reader and planner; a refused entry stays one line."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner(ckpt))
    except CheckpointException as err:  # DCP wraps every rank's error, with its traceback
        _, cause = _root_cause(err)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        if isinstance(cause, ValueError) and "mismatch" in str(cause):  # an older checkpoint: no recorded config
            raise CheckpointError(
                f"{ckpt} was saved for another model ({one_line(cause, with_type=True)}); "
                "resume with the model config it was trained with, or start a new run_dir "
                "without resume"
            ) from None
        raise
