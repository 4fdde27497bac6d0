"""``lit-titan prepare [hydra overrides] out=DIR``: tokenize a corpus once into token shards.

Takes the same overrides as ``lit_titan.train`` for the data and the tokenizer (``data=text
data.path=DIR``, ``data.max_bytes``, ``data.val_fraction``, ``data.tokenizer.*``, ``model=...`` whose
vocab size a BPE tokenizer takes), builds the same train/validation split and tokenizer as
training would (a BPE is trained on the training files and cached in ``data.data_dir/tokenizers``),
and writes litdata token shards, ``tokenizer.json`` and ``manifest.json`` into ``out=DIR``
(format: ``lit_titan/data/prepare.py``, docs/data.md). Re-running on the same input is a no-op.

    lit-titan prepare data=text data.path=corpus/ out=prepared/
    lit-titan prepare data=text data.path=corpus/ data.tokenizer.kind=hf \\
        data.tokenizer.path=llama3/tokenizer.json out=prepared/ workers=16
    lit-titan prepare out=prepared/stdlib          # the embedded corpus
    lit-titan prepare data=text data.path=corpus/ out=s3://BUCKET/PREFIX

Prepare-only arguments: ``out=DIR`` (required; a local directory: new, empty, or prepared before;
or ``s3://BUCKET/PREFIX``: prepared in a temporary directory, then uploaded with manifest.json last,
S3 settings as training takes them: AWS_* variables or ``data.storage_options``),
``workers=N`` (tokenizing processes, default: the CPU count), ``chunk_tokens=N`` (tokens per shard
file, default 4194304 = 16 MiB).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_titan.config import ConfigError, compose

# Errors that mean "fix your input": printed as one line, no traceback, exit code 2.
USER_ERRORS = (ConfigError, FileNotFoundError, FileExistsError)


@dataclass(frozen=True)
class PrepareArgs:
    out: str
    workers: int
    chunk_tokens: int
    overrides: tuple[str, ...]


def parse_args(argv: list[str]) -> PrepareArgs:
    """Split the prepare-only ``out=``/``workers=``/``chunk_tokens=`` from the Hydra overrides and check them."""
    from lit_titan.data.prepare import DEFAULT_CHUNK_TOKENS

    own: dict[str, str] = {}
    overrides = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ("out", "workers", "chunk_tokens"):
            if key in own:
                raise ConfigError(f"{key}= is given twice; pass it once")
            own[key] = value
        else:
            overrides.append(arg)
    out = own.get("out", "").strip()
    if not out:
        raise ConfigError("out=DIR is required: the directory to write the prepared shards to")
    if "://" in out and not out.startswith("s3://"):
        raise ConfigError(f"out={out}: only a local directory or s3://BUCKET/PREFIX is supported")
    return PrepareArgs(
        out=out,
        workers=_positive_int(own, "workers", os.cpu_count() or 1),
        chunk_tokens=_positive_int(own, "chunk_tokens", DEFAULT_CHUNK_TOKENS),
        overrides=tuple(overrides),
    )


def _positive_int(own: dict[str, str], key: str, default: int) -> int:
    if key not in own:
        return default
    try:
        value = int(own[key])
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{key}={own[key]}: must be a positive integer")
    return value


def prepare(argv: list[str], *, progress: bool = True) -> dict[str, Any]:
    """Check everything, then prepare (or find already prepared) the shards; returns a summary dict."""
    from lit_titan.data.prepare import check_out_dir

    start = time.perf_counter()
    args = parse_args(argv)
    cfg = compose(list(args.overrides), check=True)
    if args.out.startswith("s3://"):
        return _prepare_to_s3(args, cfg, progress, start)
    out = check_out_dir(args.out).resolve()
    return _prepare_local(args, cfg, out, progress, start)


def _prepare_to_s3(args: PrepareArgs, cfg: Any, progress: bool, start: float) -> dict[str, Any]:
    """Prepare into a temporary local directory, then upload it with manifest.json last.

    A reader takes a prefix holding manifest.json for complete (lit_titan/data/remote.py's
    upload_dir), so it never sees a manifest without its shards. The bucket is checked first,
    before any tokenizing.
    """
    from omegaconf import OmegaConf

    from lit_titan.data import remote

    options = (
        OmegaConf.to_container(cfg.data.storage_options, resolve=True) if cfg.data.get("storage_options") else None
    )
    remote.check_bucket(args.out, options)
    with tempfile.TemporaryDirectory(prefix="lit-titan-prepare-") as tmp:
        result = _prepare_local(args, cfg, Path(tmp), progress, start)
        remote.upload_dir(Path(tmp), args.out, options)
    result["out"] = args.out
    result["seconds"] = time.perf_counter() - start
    return result


def _prepare_local(args: PrepareArgs, cfg: Any, out: Path, progress: bool, start: float) -> dict[str, Any]:
    from lit_titan.data.corpus import load_corpus, split_corpus
    from lit_titan.data.prepare import current_manifest, prepare_shards

    data = cfg.data
    if data.corpus == "text":  # one line naming data.path / data.tokenizer.path (lit_titan/config/inputs.py)
        from lit_titan.config.inputs import check_documents, check_tokenizer_file

        check_documents(cfg, one_batch=False)
        if data.tokenizer.get("kind") == "hf":
            check_tokenizer_file(data.tokenizer.get("path"), None)
    try:
        corpus = load_corpus(data.corpus, data.path, data.max_bytes, data.text_key, data.encoding)
        train, val = split_corpus(corpus, float(data.val_fraction))
        tokenizer, source = _tokenizer(data, train, out)
    except ConfigError:
        raise
    except ValueError as err:  # corpus and tokenizer checks name the setting; one line, not a traceback
        raise ConfigError(str(err)) from err
    manifest = current_manifest(out, train, val, tokenizer, args.chunk_tokens)
    prepared = manifest is None
    if prepared:
        try:
            manifest = prepare_shards(
                train,
                val,
                tokenizer,
                out,
                chunk_tokens=args.chunk_tokens,
                num_workers=args.workers,
                progress=progress,
                source=source,
            )
        except ValueError as err:  # a malformed .jsonl line, found by a worker
            raise ConfigError(str(err)) from err
    return {"out": str(out), "prepared": prepared, "seconds": time.perf_counter() - start, "manifest": manifest}


def _tokenizer(data: Any, train: Any, out: Path) -> tuple[Any, dict[str, Any]]:
    """The run's tokenizer, as training builds it, and how it was made (recorded in the manifest).

    A BPE comes from the cache (trained on first use); if the cache lost it but ``out`` holds the
    one trained from the same files and settings, that one is put back instead of training again.
    """
    from lit_titan.data.prepare import TOKENIZER_FILE, read_manifest
    from lit_titan.data.tokenizers import bpe_tokenizer_path, build_tokenizer

    tok = data.tokenizer
    cache_dir = Path(str(data.data_dir)).expanduser() / "tokenizers"
    source: dict[str, Any] = {"kind": str(tok.kind)}
    if tok.kind == "bpe":
        cached = bpe_tokenizer_path(train, int(tok.vocab_size), cache_dir)
        source["bpe_cache_key"] = cached.parent.name
        previous = read_manifest(out)
        if (
            not cached.is_file()
            and previous is not None
            and previous.get("source") == source
            and (out / TOKENIZER_FILE).is_file()
        ):
            cached.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
            os.close(fd)
            shutil.copyfile(out / TOKENIZER_FILE, tmp)
            os.replace(tmp, cached)
    tokenizer = build_tokenizer(
        kind=str(tok.kind), path=tok.get("path"), vocab_size=int(tok.vocab_size), corpus=train, cache_dir=cache_dir
    )
    return tokenizer, source


def summary_line(result: dict[str, Any]) -> str:
    m = result["manifest"]
    parts = []
    for name, s in m["splits"].items():
        parts.append(
            f"{name} {s['tokens']:,} tokens, {s['documents']:,} documents, {s['chunks']} "
            f"chunk{'s' if s['chunks'] != 1 else ''}"
        )
    tok = m["tokenizer"]
    what = "; ".join(parts) + f" (vocab {tok['vocab_size']}, {m['chunk_tokens']:,} tokens per chunk)"
    if result["prepared"]:
        workers = m["splits"]["train"].get("workers")
        return (
            f"prepared {result['out']} in {result['seconds']:.1f} s with {workers} worker{'s' * (workers != 1)}: {what}"
        )
    return f"already prepared: {result['out']} holds these shards, nothing to do ({result['seconds']:.2f} s): {what}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from lit_titan.cli.usage import render

        print(render("prepare", intro=__doc__.strip(), examples=False))  # the examples are in the docstring
        return {}
    result = prepare(argv)
    print(summary_line(result))
    return result


if __name__ == "__main__":
    from lit_titan.cli.entry import run_entry_point

    run_entry_point(main, USER_ERRORS)
