"""Read one split of a prepared shard directory (local or ``s3://``) by sample index.

A chunk is a flat run of int32 tokens; sample ``j`` of a chunk is tokens
``[j * (seq_len + 1), (j + 1) * (seq_len + 1))`` (the tail shorter than a sample is unused).
Why not litdata's ``StreamingDataset``: its sample order is sharded by world size and worker,
while here the order is a pure function of the global step (``order.py``), and a rank must read
exactly the chunks that hold its samples. The file format stays litdata's (``prepare.py``).

Remote chunks are downloaded into a node-local cache directory shared by every process of the
node (TP/PP/CP peers of a data-parallel rank and loader workers download a chunk once) and
deleted once the global order has moved past their last use (``release``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from lit_titan.data.prepare import FORMAT, MANIFEST, TOKENIZER_FILE
from lit_titan.errors import ConfigError

HEADER_ITEM_BYTES = 4  # litdata chunk header: [num_items] + [num_items + 1 offsets], uint32 each


def is_remote(path: str) -> bool:
    return str(path).startswith("s3://")


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else str(Path(base, *parts))


def read_text(path: str, storage_options: dict | None = None) -> str:
    """A small file of a prepared directory (manifest, index, tokenizer), local or remote."""
    if is_remote(path):
        from lit_titan.data import remote

        return remote.read_bytes(path, storage_options).decode()
    return Path(path).read_text()


def load_manifest(root: str, storage_options: dict | None = None, *, setting: str = "data.path") -> dict[str, Any]:
    """The manifest of a prepared directory, or one line naming what is wrong with ``setting``."""
    if is_remote(root):
        from lit_titan.data import remote

        remote.preflight(root, storage_options)
    else:
        path = Path(root).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"{setting}={root}: no such directory; prepare one with "
                f"`lit-titan prepare {shlex.quote(f'out={root}')}`"
            )
        if not (path / MANIFEST).is_file():
            raise ConfigError(
                f"{setting}={root} holds no {MANIFEST}: it is not a prepared shard directory; run "
                f"`lit-titan prepare [data overrides] {shlex.quote(f'out={root}')}` first"
            )
    manifest = json.loads(read_text(_join(str(root), MANIFEST), storage_options))
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{setting}={root}: {MANIFEST} is not a {FORMAT} manifest; re-run `lit-titan prepare`")
    return manifest


def tokenizer_path(root: str) -> str:
    return _join(str(root), TOKENIZER_FILE)


class ShardSplit:
    """One split (``train``/``val``) of a prepared directory: chunk token counts and sample reads.

    Picklable (loader workers): open memory maps are dropped and re-opened per process.
    ``bytes_read`` counts, per process, the chunk bytes this process opened from local storage
    or downloaded from remote storage: the read volume the data-parallel split is judged by.
    """

    def __init__(
        self,
        root: str,
        split: str,
        *,
        cache_dir: str | os.PathLike[str],
        storage_options: dict | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> None:
        self.root, self.split = str(root), split
        self.storage_options = storage_options
        self.manifest = manifest if manifest is not None else load_manifest(self.root, storage_options)
        index = json.loads(read_text(_join(self.root, split, "index.json"), storage_options))
        self.files: list[str] = [c["filename"] for c in index["chunks"]]
        self.items = np.array([int(c["chunk_size"]) for c in index["chunks"]], dtype=np.int64)
        self.chunk_tokens = np.array([int(c["dim"]) for c in index["chunks"]], dtype=np.int64)
        self.chunk_bytes = np.array([int(c.get("chunk_bytes") or 0) for c in index["chunks"]], dtype=np.int64)
        fp = json.dumps(
            [self.manifest.get("inputs"), self.manifest.get("tokenizer"), split, self.files, self.chunk_tokens.tolist()]
        )
        self.fingerprint = hashlib.sha256(fp.encode()).hexdigest()[:16]
        self.cache_dir = Path(cache_dir).expanduser() / self.fingerprint
        self.bytes_read = 0
        self.chunks_opened = 0
        self._maps: dict[int, np.memmap] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    def samples_per_chunk(self, seq_len: int) -> np.ndarray:
        return self.chunk_tokens // (seq_len + 1)

    def _local_path(self, chunk: int) -> Path:
        name = self.files[chunk]
        if not is_remote(self.root):
            return Path(self.root).expanduser() / self.split / name
        from lit_titan.data import remote

        dest = self.cache_dir / name
        if not dest.is_file():
            # mid_run: this split's index came from the same endpoint, so a failed connection is an outage
            self.bytes_read += remote.download(
                _join(self.root, self.split, name), dest, self.storage_options, mid_run=True
            )
        return dest

    def _map(self, chunk: int) -> np.memmap:
        mm = self._maps.get(chunk)
        if mm is None:
            path = self._local_path(chunk)
            header = (1 + int(self.items[chunk]) + 1) * HEADER_ITEM_BYTES
            mm = np.memmap(path, dtype=np.int32, mode="r", offset=header, shape=(int(self.chunk_tokens[chunk]),))
            self._maps[chunk] = mm
            self.chunks_opened += 1
            if not is_remote(self.root):
                self.bytes_read += path.stat().st_size
        return mm

    def read(self, chunk: int, sample: int, seq_len: int) -> np.ndarray:
        """Sample ``sample`` of ``chunk``: ``seq_len + 1`` int32 tokens (a copy, safe after release)."""
        start = sample * (seq_len + 1)
        return np.array(self._map(chunk)[start : start + seq_len + 1])

    def release(self, chunk: int) -> None:
        """Drop this process's map of ``chunk``; a downloaded copy is deleted from the node cache.

        A peer that still needs a deleted chunk downloads it again (correct, only slower); the
        caller releases a chunk only a margin of steps after its last use, so peers in lockstep do not.
        """
        self._maps.pop(chunk, None)
        if is_remote(self.root):
            try:
                (self.cache_dir / self.files[chunk]).unlink()
            except FileNotFoundError:
                pass

    @property
    def open_chunks(self) -> list[int]:
        return sorted(self._maps)
