"""Cheap checks of what a valid config points at, run in the launching process before any rank starts.

``lit_titan.config.validate`` checks the config alone; this module looks at the machine: the data
path holds documents (text, not binary) or prepared shards, the tokenizer file loads and fits
``model.vocab_size``, the corpus can fill one global batch, ``run_dir`` is writable, and Float8 has
FP8 units. Each costs milliseconds to a second (file listings, a tokenizer.json, one capability
query); the expensive work (tokenizing, preparing shards) stays in the data module. Every failure
is one ``ConfigError`` line naming the setting, raised the same way on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lit_titan.errors import ConfigError, one_line


def check_inputs(cfg: DictConfig, model_vocab_size: int) -> None:
    """Every pre-spawn check of the data, tokenizer and hardware; raises ConfigError.

    (``run_dir`` is checked apart, by ``check_run_dir``, before Hydra creates it.)"""
    try:
        check_float8_hardware(cfg)
        check_data(cfg, model_vocab_size)
    except ConfigError as err:
        err.raised_on_every_rank = True  # type: ignore[attr-defined]  - same inputs, same answer on every rank
        raise


def check_run_dir(run_dir: Any) -> None:
    """``run_dir`` (or the nearest directory that exists above it) must be writable.

    null: the default, runs/<model>-<time>, goes under the working directory.
    """
    if not run_dir:
        if _unwritable(Path.cwd() / "runs" if (Path.cwd() / "runs").is_dir() else Path.cwd()):
            raise ConfigError(
                f"run_dir=null: the default runs/<model>-<time> would go under {Path.cwd()}, which "
                f"is not writable; set run_dir=PATH to a directory you can write"
            )
        return
    path = Path(str(run_dir)).expanduser().absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"run_dir={run_dir}: {probe} is a file, not a directory; choose another run_dir=PATH")
    problem = _unwritable(probe)
    if problem:
        raise ConfigError(
            f"run_dir={run_dir}: cannot write in {probe} ({problem}); choose a directory you can "
            f"write, e.g. run_dir=runs/my-run"
        )


def _unwritable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (None: one can). A real probe file, not os.access:
    root passes every permission check, yet cannot write on a read-only or virtual file system."""
    import tempfile

    if not os.access(directory, os.W_OK | os.X_OK):
        return "no write permission"
    try:
        fd, name = tempfile.mkstemp(prefix=".lit-titan-probe-", dir=directory)
    except OSError as err:
        return err.strerror or type(err).__name__
    os.close(fd)
    os.unlink(name)
    return None


def check_float8_hardware(cfg: DictConfig) -> None:
    """callbacks=[float8] without emulate needs CUDA compute capability >= 8.9 where training runs."""
    for name, node in (cfg.get("callbacks") or {}).items():
        if not str(node.get("_target_", "")).endswith(".Float8") or node.get("emulate"):
            continue
        accelerator = str(cfg.cluster.accelerator)
        where = f"cluster.accelerator={accelerator}"
        if accelerator in ("gpu", "cuda", "auto"):
            import torch

            if not torch.cuda.is_available():
                if accelerator == "auto":
                    where = "no CUDA device"
                else:
                    return  # the launching host may have no GPU (a login node); the callback checks on the rank
            else:
                capability = torch.cuda.get_device_capability()
                if capability >= (8, 9):
                    return
                where = f"CUDA compute capability {capability[0]}.{capability[1]}"
        raise ConfigError(
            f"callbacks.{name}.emulate=false: Float8 needs FP8 units (CUDA compute capability >= 8.9) "
            f"and this run has {where}; set callbacks.{name}.emulate=true (the numerics, no speed-up) or "
            f"drop float8 from callbacks"
        )


def check_data(cfg: DictConfig, model_vocab_size: int) -> None:
    """The corpus or shards exist and suffice; the tokenizer loads and fits the model."""
    data = cfg.data
    tok = data.get("tokenizer") or {}
    if tok.get("kind") == "bpe" and tok.get("vocab_size") is not None and int(tok.vocab_size) > model_vocab_size:
        raise ConfigError(
            f"data.tokenizer.vocab_size={tok.vocab_size}: larger than model.vocab_size="
            f"{model_vocab_size}, token ids would index past the embedding; set "
            f"data.tokenizer.vocab_size<={model_vocab_size} or raise model.vocab_size"
        )
    if tok.get("kind") == "hf" or (tok.get("kind") in (None, "shards") and tok.get("path")):
        check_tokenizer_file(tok.get("path"), model_vocab_size)
    corpus = str(data.corpus)
    if corpus == "text":
        check_documents(cfg)
    elif corpus == "tokens":
        _check_prepared("data.path", data.get("path"))
    elif corpus == "mixture":
        for i, source in enumerate(data.get("sources") or []):
            _check_prepared(f"data.sources[{i}].path", source.get("path"))


def check_tokenizer_file(path: Any, model_vocab_size: int | None) -> None:
    """data.tokenizer.path loads as a tokenizer.json (and fits ``model_vocab_size`` when given)."""
    if not path:
        raise ConfigError(
            "data.tokenizer.path=null: data.tokenizer.kind=hf needs a tokenizer.json; set "
            "data.tokenizer.path=FILE (or data.tokenizer.kind=bpe to train one on the corpus)"
        )
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"data.tokenizer.path={path}: no such file; point it at a Hugging Face tokenizer.json "
            f"(or use data.tokenizer.kind=bpe)"
        )
    from lit_titan.data.tokenizers import HFTokenizer

    try:
        tokenizer = HFTokenizer(file)
    except ValueError as err:  # loads, but has no end-of-text token: its own message names the fix
        raise ConfigError(f"data.tokenizer.path={path}: {one_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own Exception for a bad file
        raise ConfigError(
            f"data.tokenizer.path={path}: not a tokenizer.json the tokenizers library can load "
            f"({one_line(err)[:160]}); point it at a Hugging Face tokenizer.json"
        ) from None
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(
            f"data.tokenizer.path={path}: its vocabulary ({tokenizer.vocab_size} tokens) is larger "
            f"than model.vocab_size={model_vocab_size}; use a model with model.vocab_size>="
            f"{tokenizer.vocab_size} or a smaller tokenizer"
        )


def check_documents(cfg: DictConfig, *, one_batch: bool = True) -> None:
    """data=text: documents exist, are text, and (``one_batch``) hold at least one global batch of tokens."""
    from lit_titan.data.corpus import DocumentError, split_corpus, text_corpus

    data = cfg.data
    if not data.get("path"):
        raise ConfigError("data.path=null: data=text needs data.path=DIR, a directory or file of .txt/.jsonl documents")
    root = Path(str(data.path)).expanduser()
    if not root.exists():
        raise ConfigError(
            f"data.path={data.path}: no such file or directory; set data.path=DIR to your .txt/.jsonl documents"
        )
    try:
        corpus = text_corpus(root, data.get("max_bytes"), data.text_key, data.encoding)
    except DocumentError as err:  # the first document read: bytes not in data.encoding, no data.text_key field
        raise ConfigError(f"data.path={data.path}: {one_line(err)}") from None
    except (ValueError, OSError) as err:  # no documents, or only empty ones
        text = one_line(err)
        what = (
            "no .txt/.jsonl documents there"
            if text.startswith("No documents")
            else "every .txt/.jsonl document there is empty"
            if "are empty" in text
            else text
        )
        raise ConfigError(
            f"data.path={data.path}: {what}; point data.path at a directory (or file) of non-empty "
            f".txt/.jsonl documents"
        ) from None
    try:
        train, val = split_corpus(corpus, float(data.val_fraction))
        for f in (*train.files, *(val.files if val else ())):
            # Every file decodes and every .jsonl line parses (DocumentError names the first that does
            # not): a small fraction of the tokenizing that follows, and a bad file found there would
            # surface inside a rank, as a traceback, or (bytes not text) be trained on.
            for _ in corpus.documents(f):
                pass
    except ValueError as err:
        raise ConfigError(f"data.path={data.path}: {one_line(err)}") from None
    if not one_batch:
        return
    # Upper bound on the tokens: a byte-level BPE token covers >= 1 byte, plus one EOS per document
    # (at most one per file for .txt; a .jsonl line's JSON wrapping outweighs its EOS).
    most_tokens = sum(min(f.stat().st_size, data.max_bytes or f.stat().st_size) for f in train.files) + len(train.files)
    need = int(data.global_batch_size) * int(data.seq_len) + 1
    if most_tokens < need:
        raise ConfigError(
            f"data.path={data.path}: its training documents hold at most {most_tokens} tokens, fewer "
            f"than one global batch (data.global_batch_size x data.seq_len + 1 = {need}); add "
            f"documents or lower data.global_batch_size / data.seq_len"
        )


def _check_prepared(setting: str, path: Any) -> None:
    """A local prepared directory exists and has its manifest (s3:// ones are opened by the data module)."""
    if not path:
        return  # the data module names the missing setting
    text = str(path)
    if "://" in text:
        return
    root = Path(text).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"{setting}={path}: no such directory; prepare one with `lit-titan prepare data=text "
            f"data.path=DOCS out={path}`"
        )
    if not (root / "manifest.json").is_file():
        raise ConfigError(
            f"{setting}={path}: no manifest.json, so not a prepared directory; run `lit-titan "
            f"prepare data=text data.path=DOCS out={path}` first"
        )


__all__ = [
    "check_inputs",
    "check_run_dir",
    "check_float8_hardware",
    "check_data",
    "check_documents",
    "check_tokenizer_file",
]
