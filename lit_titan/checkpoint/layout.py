"""On-disk layout of checkpoints, and the checks that decide whether one can be trusted.

A checkpoint is a directory ``<run_dir>/checkpoints/step-XXXXXX`` holding a DCP (sharded) save
of model and optimizer, ``meta.pt`` (Lightning's loop, scheduler, data-loader and callback
state) and ``rng/rank-XXXXX.pt``. It is written under ``step-XXXXXX.partial`` and renamed to
its final name only after every rank finished writing (see ``writer.py``): a directory with a
final name is complete by construction; the checks below additionally catch later damage
(truncated shards, a corrupt ``.metadata``) before any rank loads it.

Loading never runs code from a checkpoint. DCP stores ``.metadata`` as a pickle and reads it with
``pickle.load``, and every non-tensor entry (the optimizer's param-group settings) with
``torch.load(weights_only=False)``: either would run any code a tampered file names.
:class:`SafeFileSystemReader` unpickles ``.metadata`` with an allow-list of DCP's own metadata
classes, and :class:`SafeLoadPlanner` reads non-tensor entries with ``torch.load(weights_only=True)``
(tensors, numbers, strings, containers); :func:`validate` reads those entries the same way before
any process loads, so a checkpoint holding anything else is refused naming the entry. Tensors,
``meta.pt`` and the RNG files are read with ``weights_only=True`` too.

Integrity: each save records a CRC-32 per file in ``checksums.json`` (:func:`write_checksums`,
computed in the writing thread); :func:`validate` with ``verify=True`` re-reads the files and
compares. CRC-32 catches storage corruption (flipped bits, torn writes); it is no defence
against someone who can rewrite the checkpoint (they can rewrite ``checksums.json`` too), which
is why loading runs no code whatever the bytes say.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import re
import shutil
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lit_titan.errors import UserError

STEP_DIR = re.compile(r"^step-(\d{6,})$")
PARTIAL_SUFFIX = ".partial"
DAMAGED_SUFFIX = ".damaged"
META_FILE = "meta.pt"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"
CHECKSUMS = "checksums.json"
CHECKSUM_PARTS = "checksums"  # per-rank records under a .partial save, merged into CHECKSUMS on publish
_CHUNK = 16 << 20


class CheckpointError(UserError):
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


def read_plain(value: io.BytesIO, entry: str, where: Path | str) -> Any:
    """A non-tensor checkpoint entry as plain data (``weights_only=True``), or a one-line refusal."""
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except Exception as err:  # weights_only refuses any global it does not know, before calling it
        reason = next(
            (
                line.strip().rstrip(".")
                for line in str(err).splitlines()
                if "unsupported" in line.lower() or "GLOBAL" in line
            ),
            _first_line(err),
        )
        raise CheckpointError(
            f"{where}: entry {entry} holds more than tensors and plain data ({reason}); "
            "refused unloaded (loading never runs code from a checkpoint): use a checkpoint "
            "this program wrote"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries as plain data (DCP's own uses ``weights_only=False``)."""

    def __init__(self, where: Path | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = read_plain(value, fqn, self._where)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint import default_planner  # set_element: DCP's own, as it uses it

            default_planner.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


# ---- checksums ------------------------------------------------------------------------------------
def file_crc32(path: Path) -> str:
    """CRC-32 of a file (zlib; about 4 GB/s a core here, twice sha256, and it releases the GIL)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_checksums(staging: Path, rank: int, files: list[Path]) -> None:
    """This rank's record (file relative to the checkpoint -> CRC-32), under ``checksums/``."""
    record = {str(f.relative_to(staging)): file_crc32(f) for f in files}
    parts = staging / CHECKSUM_PARTS
    parts.mkdir(exist_ok=True)
    (parts / f"rank-{rank:05d}.json").write_text(json.dumps(record, sort_keys=True))


def merge_checksums(staging: Path) -> None:
    """Rank 0, once every rank's write is done: one ``checksums.json`` (plus ``.metadata``'s)."""
    files: dict[str, str] = {}
    parts = staging / CHECKSUM_PARTS
    for part in sorted(parts.glob("rank-*.json")):
        files.update(json.loads(part.read_text()))
    files[DCP_METADATA] = file_crc32(staging / DCP_METADATA)
    (staging / CHECKSUMS).write_text(json.dumps({"algorithm": "crc32", "files": files}, indent=0, sort_keys=True))
    shutil.rmtree(parts, ignore_errors=True)


def verify_checksums(ckpt: Path) -> bool:
    """Re-read every file ``checksums.json`` lists and compare; False when the checkpoint has none
    (written before checksums were recorded). Raises :class:`CheckpointError` naming the file."""
    record = ckpt / CHECKSUMS
    if not record.is_file():
        return False
    try:
        data = json.loads(record.read_text())
        files, algorithm = dict(data["files"]), data.get("algorithm")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{ckpt}/{CHECKSUMS} is corrupt ({_first_line(err)})") from None
    if algorithm != "crc32":
        raise CheckpointError(f"{ckpt}/{CHECKSUMS} uses checksum {algorithm!r}; this version knows crc32")
    for name, expected in sorted(files.items()):
        path = ckpt / name
        if not path.resolve().is_relative_to(ckpt.resolve()):
            raise CheckpointError(f"{ckpt}/{CHECKSUMS} names a file outside the checkpoint ({name})")
        try:
            actual = file_crc32(path)
        except OSError as err:  # missing, or set aside by another process of this job meanwhile
            raise CheckpointError(f"{ckpt}/{name} cannot be read ({_first_line(err)})") from None
        if actual != expected:
            raise CheckpointError(
                f"{ckpt}/{name} does not match its checksum (the file changed after it was "
                "written: storage corruption or an edit)"
            )
    return True


# ---- validation ---------------------------------------------------------------------------------
def validate(ckpt: Path, *, staged: bool = False, verify: bool = False) -> None:
    """Raise :class:`CheckpointError` unless ``ckpt`` is a complete, undamaged checkpoint.

    Without ``verify`` cheap (metadata, file sizes and the few small non-tensor entries, no tensor
    data): interrupted saves, truncated or missing shard files, a corrupt ``.metadata``/``meta.pt``,
    and non-tensor entries that are not plain data. ``verify``: also re-read every file against
    ``checksums.json`` (bytes flipped inside a shard), reading the whole checkpoint.
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
            raise CheckpointError(
                f"{ckpt}/{name} is truncated ({sizes[name]} bytes, the metadata needs {info.offset + info.length})"
            )
    if verify:  # before reading any entry: a flipped bit is named as such, not as a bad entry
        verify_checksums(ckpt)
    _check_plain_entries(ckpt, metadata)
    try:
        torch.load(ckpt / META_FILE, weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{ckpt}/{META_FILE} is corrupt ({type(err).__name__}: {err})") from None


def _check_plain_entries(ckpt: Path, metadata: dcp_metadata.Metadata) -> None:
    """Every non-tensor entry reads as plain data (about 26 small ones for AdamW: its param groups)."""
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), dcp_metadata.BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):  # compression etc.: lit-titan never writes them
            raise CheckpointError(
                f"{ckpt}: entry {index.fqn} is stored with transforms "
                f"{list(info.transform_descriptors)}, which lit-titan does not write"
            )
        with open(ckpt / str(info.relative_path), "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        read_plain(io.BytesIO(raw), index.fqn, ckpt)


def latest_valid(directory: Path, *, verify: bool = False) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint in ``directory`` that passes :func:`validate`, and the newer ones skipped (why)."""
    skipped: list[tuple[Path, str]] = []
    for ckpt in reversed(published(directory)):
        try:
            validate(ckpt, verify=verify)
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
