"""On-disk layout of checkpoints, and the checks that decide whether one can be trusted.

A checkpoint is a directory ``<run_dir>/checkpoints/step-XXXXXX`` holding a DCP (sharded) save
of model and optimizer, ``meta.pt`` (Lightning's loop, scheduler, data-loader and callback
state) and ``rng/rank-XXXXX.pt``. It is written under ``step-XXXXXX.partial`` and renamed to
its final name only after every rank finished writing (see ``writer.py``): a directory with a
final name is complete by construction; the checks below additionally catch later damage
(truncated shards, a corrupt ``.metadata``) before any rank loads it.

DCP stores ``.metadata`` as a pickle and reads it with ``pickle.load``, which would run any code a
tampered file names. :class:`SafeFileSystemReader` unpickles it with an allow-list of DCP's own
metadata classes instead, so loading a checkpoint never executes pickled code; tensors and
``meta.pt`` are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import pathlib
import pickle
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

STEP_DIR = re.compile(r"^step-(\d{6,})$")
PARTIAL_SUFFIX = ".partial"
DAMAGED_SUFFIX = ".damaged"
META_FILE = "meta.pt"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; the message says why and what to use instead."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def partial_path(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL_SUFFIX)


def rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank-{rank:05d}.pt"


def checkpoint_step(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def staged_step(path: Path) -> int | None:
    """The step of an unpublished ``step-XXXXXX.partial`` save."""
    name = path.name
    return checkpoint_step(path.with_name(name[: -len(PARTIAL_SUFFIX)])) if name.endswith(PARTIAL_SUFFIX) else None


def published(directory: Path) -> list[Path]:
    """Published (final-named) checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p))


# ---- safe reading of DCP's pickled metadata -----------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the classes DCP's ``.metadata`` is made of (plus dtypes, sizes, paths)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            return _StorageInfo
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return getattr(pathlib, name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's {DCP_METADATA}")


def read_dcp_metadata(ckpt: Path) -> dcp_metadata.Metadata:
    with open(ckpt / DCP_METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the allow-list unpickler for ``.metadata`` (see module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- validation ---------------------------------------------------------------------------------
def validate(ckpt: Path, *, staged: bool = False) -> None:
    """Raise :class:`CheckpointError` unless ``ckpt`` is a complete, undamaged checkpoint.

    Cheap (metadata and file sizes only, no tensor data is read), so every candidate of
    ``resume=auto`` can be checked. Catches interrupted saves, truncated or missing shard files
    and a corrupt ``.metadata``/``meta.pt``; it cannot catch bytes flipped inside a shard.
    ``staged``: check a finished save under its ``.partial`` name, before publishing it.
    """
    if ckpt.name.endswith(PARTIAL_SUFFIX) and not staged:
        raise CheckpointError(f"{ckpt} is an unpublished save (interrupted before every rank finished)")
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt} is not a checkpoint directory")
    for required in (DCP_METADATA, META_FILE):
        if not (ckpt / required).is_file():
            raise CheckpointError(f"{ckpt} has no {required}: the save was interrupted or the directory was damaged")
    try:
        metadata = read_dcp_metadata(ckpt)
    except Exception as err:  # any unpickling failure means the file cannot be trusted
        raise CheckpointError(f"{ckpt}/{DCP_METADATA} is corrupt ({type(err).__name__}: {err})") from None
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if name not in sizes:
            shard = ckpt / name
            sizes[name] = shard.stat().st_size if shard.is_file() else -1
        if sizes[name] < 0:
            raise CheckpointError(f"{ckpt} is missing the shard file {name}")
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(f"{ckpt}/{name} is truncated ({sizes[name]} bytes, the metadata needs "
                                  f"{info.offset + info.length})")
    try:
        torch.load(ckpt / META_FILE, weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{ckpt}/{META_FILE} is corrupt ({type(err).__name__}: {err})") from None


def latest_valid(directory: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint in ``directory`` that passes :func:`validate`, and the newer ones skipped (why)."""
    skipped: list[tuple[Path, str]] = []
    for ckpt in reversed(published(directory)):
        try:
            validate(ckpt)
            return ckpt, skipped
        except CheckpointError as err:
            skipped.append((ckpt, str(err)))
    return None, skipped


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint out of the way (never delete it): ``step-XXXXXX.damaged[-N]``."""
    target = ckpt.with_name(ckpt.name + DAMAGED_SUFFIX)
    n = 0
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{ckpt.name}{DAMAGED_SUFFIX}-{n}")
    try:
        ckpt.rename(target)
    except FileNotFoundError:  # another process of this job moved it first
        pass
    return target


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` published checkpoints and any unpublished save older than them."""
    if keep <= 0:
        return []
    done = published(directory)
    removed = done[:-keep]
    oldest_kept = checkpoint_step(done[-keep]) if len(done) >= keep else None
    for stale in directory.glob(f"step-*{PARTIAL_SUFFIX}"):
        step = staged_step(stale)
        if oldest_kept is not None and step is not None and step < oldest_kept:
            removed.append(stale)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
