"""Disk space for checkpoints: a preflight before training, and pruning *before* each write.

A checkpoint's size is known from the state (every rank's tensor bytes, summed over the ranks:
they all write into the same directory), so a run can tell before its first step whether
``checkpoint.keep_last`` checkpoints fit, instead of filling the disk at the third save and
ending with a raw traceback from deep inside ``torch.save``. Before each save the oldest complete
checkpoint beyond ``keep_last - 1`` is deleted, so the new one is written into the space it frees
(peak: ``keep_last`` checkpoints, not ``keep_last + 1``); the newest complete checkpoint is never
deleted before its successor is published, so ``keep_last=1`` peaks at 2.

These functions only decide; :class:`~lit_titan.checkpoint.CheckpointWriter` runs them on rank 0
and makes every rank agree on the outcome.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lit_titan.checkpoint.layout import PARTIAL_SUFFIX, checkpoint_step, published, staged_step
from lit_titan.checkpoint.staging import local_bytes, local_tensors

# What a checkpoint adds on disk to its tensor bytes: DCP frames every tensor as its own
# torch.save record (~1.5 KB each in the .distcp file, ~0.3 KB in .metadata: measured on
# lit-titan's tiny model, 110 tensors, 2.26 MB of tensors -> 2.43 MB of shards), and each rank
# writes an RNG file (16 KB) and rank 0 meta.pt (a few KB: loops, scheduler, data position).
TENSOR_OVERHEAD = 4096
PER_RANK_OVERHEAD = 1 << 20
SETTINGS_HINT = (
    "lower checkpoint.keep_last, raise checkpoint.every_n_steps, or set run_dir to a filesystem with more free space"
)


def checkpoint_disk_bytes(tensor_bytes: int, n_tensors: int, world_size: int) -> int:
    """Bytes one checkpoint takes on disk (with a margin): all ranks' tensor bytes and tensor count."""
    return tensor_bytes + n_tensors * TENSOR_OVERHEAD + world_size * PER_RANK_OVERHEAD


def expected_state(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> tuple[int, int]:
    """This rank's checkpointed (tensor bytes, tensor count), also before the first step (optimizer state is lazy).

    Model: its state dict's local shards. Optimizer: its state when it has one for every
    parameter (a resumed run); otherwise the state Adam/AdamW will create (two moments, three with
    ``amsgrad``, per parameter plus a 4-byte step), SGD's momentum buffer, or, for any other
    optimizer, two moments per parameter (an assumption, stated in the docs).
    """
    model_state = model.state_dict()
    nbytes, count = local_bytes(model_state), sum(1 for _ in local_tensors(model_state))
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params and all(optimizer.state.get(p) for p in params):
            state = [optimizer.state[p] for p in params]
            nbytes, count = nbytes + local_bytes(state), count + sum(1 for _ in local_tensors(state))
            continue
        for group in optimizer.param_groups:
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                moments, step = (3 if group.get("amsgrad") else 2), 1
            elif isinstance(optimizer, torch.optim.SGD):
                moments, step = (1 if group.get("momentum") else 0), 0
            else:
                moments, step = 2, 1
            for p in group["params"]:
                nbytes += moments * local_bytes(p) + 4 * step
                count += moments + step
    return nbytes, count


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``directory``."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def fmt(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


@dataclass
class SavePlan:
    """What rank 0 does before writing checkpoint ``name``: delete ``prune``, or stop with ``error``."""

    name: str
    prune: list[Path] = field(default_factory=list)
    error: str | None = None


def plan_save(directory: Path, name: str, ckpt_bytes: int, keep_last: int) -> SavePlan:
    """Prune-before-write for the checkpoint ``name`` (``step-XXXXXX``) of ``ckpt_bytes``.

    With ``keep_last=K > 0`` at most ``max(K - 1, 1)`` complete checkpoints stay while the new one
    is written (the newest complete one always stays); unpublished saves older than the new one
    go too. Nothing is deleted when the new checkpoint would not fit even so.
    """
    complete = published(directory)
    prune: list[Path] = []
    if keep_last > 0:
        keep = max(keep_last - 1, 1)
        prune = complete[:-keep] if len(complete) > keep else []
    step = checkpoint_step(directory / name)
    if directory.is_dir() and step is not None:
        prune += [p for p in directory.glob(f"step-*{PARTIAL_SUFFIX}") if (staged_step(p) or step + 1) <= step]
    # (an unpublished save of this step or older: an interrupted earlier attempt, never loaded)
    freed = sum(dir_bytes(p) for p in prune)
    free = free_bytes(directory)
    if free + freed >= ckpt_bytes:
        return SavePlan(name, prune)
    kept = [p for p in complete if p not in prune]
    newest = f"; the newest complete checkpoint {complete[-1].name} is kept" if complete else ""
    return SavePlan(
        name,
        error=(
            f"checkpoint {name} does not fit in {directory}: it needs {fmt(ckpt_bytes)}, {fmt(free)} free"
            + (f" (+{fmt(freed)} from pruning to checkpoint.keep_last={keep_last})" if freed else "")
            + f" with {len(kept)} complete checkpoint(s) kept{newest}; {SETTINGS_HINT}"
        ),
    )


def remove(paths: Iterable[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def planned_saves(start_step: int, max_steps: int, every_n_steps: int) -> int | None:
    """How many checkpoints a run from ``start_step`` to ``max_steps`` writes (None: unbounded run)."""
    if max_steps is None or max_steps < 0:
        return None
    if max_steps <= start_step:
        return 0
    periodic = (max_steps // every_n_steps - start_step // every_n_steps) if every_n_steps else 0
    final = 0 if every_n_steps and max_steps % every_n_steps == 0 else 1
    return periodic + final


def preflight_error(
    directory: Path,
    ckpt_bytes: int,
    state_bytes: int,
    world_size: int,
    keep_last: int,
    every_n_steps: int,
    n_saves: int | None,
) -> str | None:
    """Whether this run's checkpoints fit next to what is already in ``directory`` (None) or why not.

    At its peak the run holds ``min(saves, max(keep_last, 2))`` new checkpoints (``keep_last=1``:
    the newest complete one stays while its successor is written; ``keep_last=0``: every save);
    checkpoints already there count as freeable once pruning would remove them.
    """
    cap = max(keep_last, 2) if keep_last > 0 else math.inf
    saves = n_saves if n_saves is not None else (cap if keep_last > 0 else 1)
    new = int(min(saves, cap))
    if new == 0:
        return None
    existing = published(directory)
    survive = int(min(len(existing), max(cap - new, 0)))
    freed = sum(dir_bytes(p) for p in existing[: len(existing) - survive])
    need = new * ckpt_bytes
    free = free_bytes(directory)
    if free + freed >= need:
        return None
    held = (
        f"checkpoint.keep_last={keep_last} holds up to {new} at once"
        if keep_last > 0
        else f"checkpoint.keep_last=0 keeps all {new} saves of checkpoint.every_n_steps={every_n_steps}"
    )
    return (
        f"checkpoints will not fit in {directory}: each needs {fmt(ckpt_bytes)} ({fmt(state_bytes)} of model "
        f"and optimizer state over {world_size} rank(s)) and {held}: {fmt(need)} needed, {fmt(free)} free"
        + (f" (+{fmt(freed)} of older checkpoints pruned)" if freed else "")
        + f"; {SETTINGS_HINT}"
    )
