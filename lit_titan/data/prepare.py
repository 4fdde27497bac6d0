"""Prepare once: documents -> litdata token shards + a manifest, read by every later run.

Layout of a prepared directory (local, or uploaded as-is to ``s3://BUCKET/PREFIX``)::

    manifest.json      what the shards hold (below); written last, so its presence == complete
    tokenizer.json     the tokenizer that made them (HF ``tokenizers`` format)
    train/             litdata ``optimize`` output: index.json + chunk-*.bin (TokensLoader format)
    val/               the held-out documents, same format (absent when there are none)

The shards are sequence-length independent: a chunk is a flat run of int32 tokens, every
document followed by the EOS id; the reader cuts ``seq_len + 1`` samples out of each chunk.
Why litdata's format: its ``optimize`` writes chunks with many worker processes and uploads
to object stores, and its index records each chunk's token count, which is all a reader needs
to map a sample to the chunk (and byte range) that holds it.

Worker processes: the sorted files are cut into ``num_workers`` contiguous runs, worker ``w``
writes ``chunk-w-*.bin`` in file order (litdata's ordered mode, not its default shared work
queue, whose chunk contents depend on timing) and the index lists worker 0's chunks first. So
the token stream read in index order is the same for any worker count, and the chunk files are
byte-identical for a given input and worker count; what the worker count changes is where
chunks end (each worker's last chunk is short), hence which ``seq_len + 1`` samples a reader cuts.
The manifest records it per split; the up-to-date check ignores it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_titan.data.corpus import Corpus
from lit_titan.data.tokenizers import HFTokenizer, Tokenizer, tokenizer_fingerprint

FORMAT = "lit-titan-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
# 4M int32 tokens = 16 MiB per chunk: large enough that an S3 GET is bandwidth-bound, not
# request-bound (docs/data.md), small enough that a rank's cache holds a few per stream.
DEFAULT_CHUNK_TOKENS = 1 << 22


# Tokens per item handed to litdata's writer: a chunk is closed before an item that would overflow
# it, so items of at most 1/16 of a chunk keep chunks >= 15/16 full, and a huge file or document
# never sits in one worker's memory (or in one oversized chunk) whole.
PIECES_PER_CHUNK = 16


class _TokenizeFile:
    """Picklable ``optimize`` fn: one file -> int32 tensors of ``piece_tokens`` (its documents, each + eos).

    The EOS id is the only document boundary, so an EOS that a document's own text encodes to
    (the literal ``<|end_of_text|>``) is dropped: it would split the document and make the
    manifest's document count wrong.
    """

    def __init__(self, corpus: Corpus, tokenizer: Tokenizer, piece_tokens: int, error_dir: Path) -> None:
        self.corpus = corpus  # how its files are read (text_key, encoding)
        self.tokenizer = tokenizer
        self.piece_tokens = piece_tokens
        self.error_dir = error_dir

    def __call__(self, path: str) -> Iterator[torch.Tensor]:
        # A malformed file is reported through ``error_dir``, not raised: litdata 0.2.76's error path
        # terminates the worker but leaves its forked helpers alive, holding the caller's stdout open.
        if any(self.error_dir.iterdir()):
            return  # another file failed: the run is lost, skip the work
        try:
            yield from self._pieces(path)
        except ValueError as err:  # DocumentError: a bad .jsonl line, bytes not in data.encoding
            (self.error_dir / f"{os.getpid()}-{time.time_ns()}.txt").write_text(str(err))

    def _pieces(self, path: str) -> Iterator[torch.Tensor]:
        eos = self.tokenizer.eos_id
        end = np.array([eos], dtype=np.int32)
        pending: list[np.ndarray] = []
        n = 0
        for doc in self.corpus.documents(Path(path)):
            ids = np.asarray(self.tokenizer.encode(doc), dtype=np.int32)
            if (ids == eos).any():
                ids = ids[ids != eos]
            pending += [ids, end]
            n += ids.size + 1
            if n >= self.piece_tokens:
                flat = np.concatenate(pending)
                full = n - n % self.piece_tokens
                for start in range(0, full, self.piece_tokens):
                    yield torch.from_numpy(flat[start : start + self.piece_tokens].copy())
                pending, n = [flat[full:]], n - full
        if n:
            yield torch.from_numpy(np.concatenate(pending))


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    """What the manifest records of a tokenizer; training compares ``fingerprint``."""
    return {
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": int(tokenizer.eos_id),
    }


def _write_split(
    corpus: Corpus, tokenizer: Tokenizer, out: Path, chunk_tokens: int, num_workers: int, progress: bool
) -> dict[str, int]:
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    files = corpus.files

    workers = max(1, min(num_workers, len(files)))
    if progress:
        print(
            f"{out.name}: tokenizing {len(files)} files with {workers} worker{'s' * (workers > 1)}",
            file=sys.stderr,
            flush=True,
        )
    # litdata prints a dozen set-up lines to stdout; its progress bar (tqdm, on stderr) is what we want.
    errors = out.with_name(f".{out.name}-errors")
    errors.mkdir()
    with contextlib.redirect_stdout(io.StringIO()):
        optimize(
            fn=_TokenizeFile(corpus, tokenizer, max(1, chunk_tokens // PIECES_PER_CHUNK), errors),
            inputs=[str(f) for f in files],
            output_dir=str(out),
            chunk_size=chunk_tokens,
            item_loader=TokensLoader(),
            num_workers=workers,
            reorder_files=False,  # contiguous runs of the sorted files per worker ...
            keep_data_ordered=True,  # ... each written in order (the default work queue is timing-dependent)
            start_method="fork" if os.name == "posix" else None,
            # litdata's tqdm bar (position=-1) moves the cursor with escape codes: on a terminal only. A
            # log file (CI, Slurm) gets the plain "tokenizing ..." line above and the summary after.
            verbose=progress and sys.stderr.isatty(),
        )
    reports = sorted(errors.iterdir())
    if reports:
        raise ValueError(reports[0].read_text())
    return {**split_stats(out, tokenizer.eos_id), "workers": workers}


def split_stats(split_dir: Path, eos_id: int) -> dict[str, int]:
    """Token, document (EOS) and chunk counts of one written split."""
    index = json.loads((split_dir / "index.json").read_text())
    tokens = documents = 0
    for chunk in index["chunks"]:
        header = (1 + int(chunk["chunk_size"]) + 1) * 4
        data = np.memmap(split_dir / chunk["filename"], dtype=np.int32, mode="r", offset=header)
        tokens += int(chunk["dim"])
        documents += int(np.count_nonzero(data[: int(chunk["dim"])] == eos_id))
        del data
    return {"tokens": tokens, "documents": documents, "chunks": len(index["chunks"])}


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(directory).expanduser() / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def check_out_dir(out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir`` as a Path if prepare may write there: new, empty, or a prepared directory."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose a directory for out=")
    if out.is_dir() and read_manifest(out) is None and any(out.iterdir()):
        raise FileExistsError(
            f"{out} exists and is not a prepared shard directory (no {MANIFEST}); choose an empty or new out= directory"
        )
    return out


def current_manifest(
    out_dir: str | os.PathLike[str], train: Corpus, val: Corpus | None, tokenizer: Tokenizer, chunk_tokens: int
) -> dict[str, Any] | None:
    """The manifest of ``out_dir`` if it already holds exactly these shards, else ``None``.

    Up to date means the same input files (paths, sizes, mtimes, split), tokenizer (content hash)
    and chunk size; the worker count is not compared (it moves chunk ends, never the tokens).
    """
    current = read_manifest(out_dir)
    inputs = {"train": train.fingerprint, "val": val.fingerprint if val is not None else None}
    if (
        current is not None
        and current.get("format") == FORMAT
        and current.get("version") == FORMAT_VERSION
        and (
            current.get("inputs") == inputs
            and current.get("tokenizer") == tokenizer_identity(tokenizer)
            and current.get("chunk_tokens") == chunk_tokens
        )
    ):
        return current
    return None


def prepare_shards(
    train: Corpus,
    val: Corpus | None,
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    num_workers: int = 1,
    progress: bool = False,
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Tokenize ``train`` (and ``val``) into ``out_dir``; a no-op when it already holds them.

    Built in a sibling temp dir and renamed into place, so a crash never leaves a directory a
    later run would trust. ``source`` (how the tokenizer was made, e.g. its BPE cache key) is
    recorded in the manifest as is. Returns the manifest.
    """
    if chunk_tokens < 1 or num_workers < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} and num_workers={num_workers} must both be >= 1")
    current = current_manifest(out_dir, train, val, tokenizer, chunk_tokens)
    if current is not None:
        return current
    out = check_out_dir(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        tmp.mkdir()
        splits = {"train": _write_split(train, tokenizer, tmp / "train", chunk_tokens, num_workers, progress)}
        if val is not None:
            splits["val"] = _write_split(val, tokenizer, tmp / "val", chunk_tokens, num_workers, progress)
        if isinstance(tokenizer, HFTokenizer):
            shutil.copyfile(tokenizer.path, tmp / TOKENIZER_FILE)
        inputs = {"train": train.fingerprint, "val": val.fingerprint if val is not None else None}
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": tokenizer_identity(tokenizer),
            "dtype": "int32",
            "chunk_tokens": chunk_tokens,
            "inputs": inputs,
            "corpus": str(train.root),
            "splits": splits,
            "source": dict(source or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)  # stale: other inputs or tokenizer
        try:
            tmp.rename(out)
        except OSError:
            if read_manifest(out) is None:
                raise
        return read_manifest(out) or manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
