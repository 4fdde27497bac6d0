"""Corpora: a deterministic, sorted list of document files.

Why files rather than texts: file paths + sizes + mtimes give a cheap fingerprint, so caches
(tokenizer, token chunks) can be validated without reading the data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from lit_titan.data.settings import DEFAULT_ENCODING, DEFAULT_MAX_BYTES, DEFAULT_TEXT_KEY

CORPUS_KINDS = ("stdlib", "text")
TEXT_SUFFIXES = (".txt", ".jsonl")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
BINARY_PROBE_BYTES = 8192  # a text document has no NUL byte in its first 8 KiB; a binary file almost always does


@dataclass(frozen=True)
class Corpus:
    """Sorted document files; ``.jsonl`` files hold one document per line (its ``text_key`` field).

    The user's files (``kind="text"``) are decoded strictly with ``encoding``: a byte that is not
    text there is an error, never a replacement character trained on. The interpreter's own
    sources (``stdlib``) keep replacement: a few test files there are deliberately not UTF-8.
    """

    kind: str
    root: Path
    files: tuple[Path, ...]
    max_bytes: int | None = None
    text_key: str = DEFAULT_TEXT_KEY
    encoding: str = DEFAULT_ENCODING

    @property
    def fingerprint(self) -> str:
        """Hash of (kind, relative paths, sizes, mtimes, max_bytes, how they are read): changes iff the
        inputs do. The default reading adds nothing, so caches made before those settings stay valid."""
        h = hashlib.sha256(f"{self.kind}:{self.root}:{self.max_bytes}\n".encode())
        if (self.text_key, self.encoding) != (DEFAULT_TEXT_KEY, DEFAULT_ENCODING):
            h.update(f"read:{self.text_key}:{self.encoding}\n".encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]

    def documents(self, path: Path) -> Iterator[str]:
        """The non-empty documents of one of this corpus's files, read as its settings say."""
        return read_documents(path, self.text_key, self.encoding, strict=self.kind != "stdlib")

    def iter_texts(self) -> Iterator[str]:
        """Yield non-empty documents in a fixed order."""
        for f in self.files:
            yield from self.documents(f)


def _relative_key(corpus: Corpus, f: Path) -> str:
    """``f``'s path relative to the corpus root (its name when the corpus is a single file)."""
    try:
        rel = f.relative_to(corpus.root).as_posix()
    except ValueError:
        rel = f.name
    return f.name if rel in ("", ".") else rel


def val_hash(rel_path: str) -> float:
    """Stable position of a relative path in ``[0, 1)``: sha256, independent of machine and layout."""
    return int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_corpus(corpus: Corpus, val_fraction: float) -> tuple[Corpus, Corpus | None]:
    """Split ``corpus`` by document file into ``(train, val)``; ``val`` is ``None`` when empty.

    A file goes to validation when :func:`val_hash` of its path relative to the corpus root is
    below ``val_fraction``, so the split depends only on the file names (not on the machine,
    the parallel layout, the seed or which other files exist); growing ``data.max_bytes`` keeps
    earlier val files in val. If ``val_fraction > 0`` picks no file, the last file (sorted order)
    is used, unless it is the only one. At least one file always stays in training: if every
    file hashed into val, the one with the largest hash goes back to training.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}.")
    files = corpus.files
    if val_fraction == 0.0 or len(files) < 2:
        return corpus, None
    hashes = [val_hash(_relative_key(corpus, f)) for f in files]
    is_val = [h < val_fraction for h in hashes]
    if not any(is_val):
        is_val[-1] = True  # deterministic fallback
    if all(is_val):
        is_val[max(range(len(files)), key=lambda i: (hashes[i], i))] = False
    train = replace(corpus, files=tuple(f for f, v in zip(files, is_val) if not v))
    val = replace(corpus, files=tuple(f for f, v in zip(files, is_val) if v))
    if next(train.iter_texts(), None) is None:
        raise ValueError(
            f"data.val_fraction={val_fraction} leaves only empty documents for training in {corpus.root}; "
            "lower data.val_fraction (0 disables validation) or add documents."
        )
    if next(val.iter_texts(), None) is None:  # only empty documents: nothing to validate on
        return train, None
    return train, val


class DocumentError(ValueError):
    """A document file that cannot be read as the data settings say; the message names the file and the fix."""


def read_documents(
    path: Path, text_key: str = DEFAULT_TEXT_KEY, encoding: str = DEFAULT_ENCODING, *, strict: bool = True
) -> Iterator[str]:
    """Documents of one file: the whole file, or each ``text_key`` field of a ``.jsonl``.

    ``strict``: bytes that are not ``encoding`` raise ``DocumentError`` naming the byte offset
    (otherwise they become U+FFFD)."""
    errors = "strict" if strict else "replace"
    if path.suffix != ".jsonl":
        raw = path.read_bytes()
        if strict:
            _refuse_binary(path, raw[:BINARY_PROBE_BYTES])
        text = _decode(path, raw, 0, encoding, errors)
        if text.strip():  # whitespace-only files are empty documents
            yield text
        return
    offset = 0
    with path.open("rb") as fh:
        if strict:
            _refuse_binary(path, fh.read(BINARY_PROBE_BYTES))
            fh.seek(0)
        for lineno, raw in enumerate(fh, 1):
            line, offset = _decode(path, raw, offset, encoding, errors), offset + len(raw)
            if line.strip():
                text = _record_text(path, lineno, line, text_key)
                if text.strip():
                    yield text


def _refuse_binary(path: Path, head: bytes) -> None:
    """A NUL byte near the start: a binary file (a model, an archive) that happens to end in .txt/.jsonl."""
    if b"\0" in head:
        raise DocumentError(
            f"{path} is a binary file, not text; remove it or point data.path at .txt/.jsonl documents only"
        )


def _decode(path: Path, raw: bytes, offset: int, encoding: str, errors: str) -> str:
    """``raw`` (found at byte ``offset`` of ``path``) as text; the first undecodable byte is named."""
    try:
        return raw.decode(encoding, errors)
    except UnicodeDecodeError as err:
        raise DocumentError(
            f"{path}: not {encoding} text at byte {offset + err.start} ({err.reason}); set "
            f"data.encoding to the files' encoding (e.g. data.encoding=latin-1) or convert them to {encoding}"
        ) from None


def _record_text(path: Path, lineno: int, line: str, text_key: str) -> str:
    """The ``text_key`` field of one ``.jsonl`` record; a record without it is an error naming the key to set."""
    bad = f"{path}:{lineno}: not a JSON object with a {text_key!r} field"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DocumentError(f"{bad} ({e}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise DocumentError(f"{bad} (a JSON {type(record).__name__}); fix or remove that line")
    if text_key not in record:
        strings = [k for k, v in record.items() if isinstance(v, str)]
        hint = f"data.text_key={strings[0]}" if strings else "data.text_key=KEY"
        raise DocumentError(
            f"{path}:{lineno}: records have no {text_key!r} field (this one has {sorted(record)[:8]}); "
            f"set {hint} to the field that holds the text"
        )
    text = "" if record[text_key] is None else record[text_key]  # null: an empty document
    if not isinstance(text, str):
        raise DocumentError(
            f"{path}:{lineno}: the {text_key!r} field is a {type(text).__name__}, not a string; "
            f"set data.text_key to the field that holds the text"
        )
    return text


def _cap(files: list[Path], max_bytes: int | None, root: Path) -> list[Path]:
    """A deterministic sample of files fitting in ``max_bytes`` (always at least one file).

    Files are taken in the order of a stable hash of their path relative to ``root``, not
    alphabetically: an alphabetical prefix of the stdlib is dominated by a few packages (dozens of
    near-identical ``encodings/cp*.py`` tables), on which a model overfits and then collapses when
    the stream moves on (seen: loss 1.9 -> 8.1 at step 84 of the default job).
    """
    if max_bytes is None:
        return files
    by_hash = sorted(files, key=lambda f: _stable_hash(f, root))
    kept: set[Path] = set()
    total = 0
    for f in by_hash:
        size = f.stat().st_size
        if kept and total + size > max_bytes:
            continue
        kept.add(f)
        total += size
    return [f for f in files if f in kept]


def _stable_hash(path: Path, root: Path) -> str:
    # Salted: the validation split hashes the same relative paths (``val_hash``), and an unsalted
    # sample would be exactly the files that split sends to validation.
    rel = path.relative_to(root) if path.is_relative_to(root) else path
    return hashlib.sha256(b"sample:" + rel.as_posix().encode()).hexdigest()


# Cached: the interpreter's own sources do not change while it runs, and walking them (1,800 files) cost a
# tenth of a small training run's host time in a process that trains many times (a notebook, the test worlds).
@functools.cache
def stdlib_corpus(max_bytes: int | None = DEFAULT_MAX_BYTES) -> Corpus:
    """The running interpreter's standard library ``.py`` sources: always present, nothing to download."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = sorted(
        (p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts) and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    return _checked(Corpus("stdlib", root, tuple(_cap(files, max_bytes, root)), max_bytes), "the Python stdlib")


def text_corpus(
    path: str | os.PathLike[str],
    max_bytes: int | None = None,
    text_key: str = DEFAULT_TEXT_KEY,
    encoding: str = DEFAULT_ENCODING,
) -> Corpus:
    """A user directory (recursively) or single file of ``.txt`` / ``.jsonl`` documents."""
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise FileNotFoundError(
            f"Corpus path not found: {root}. Set data.path=DIR to a directory (or file) of .txt/.jsonl files."
        )
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            (p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    corpus = Corpus("text", root, tuple(_cap(files, max_bytes, root)), max_bytes, text_key, encoding)
    return _checked(corpus, str(root))


def _checked(corpus: Corpus, where: str) -> Corpus:
    if not corpus.files:
        raise ValueError(
            f"No documents found in {where} (looked for {', '.join(TEXT_SUFFIXES)}). "
            "Set data.path=DIR to a directory containing .txt/.jsonl files."
        )
    if next(corpus.iter_texts(), None) is None:
        raise ValueError(
            f"All documents in {where} are empty. Set data.path=DIR to a directory with non-empty .txt/.jsonl files."
        )
    return corpus


def load_corpus(
    kind: str,
    path: str | os.PathLike[str] | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    text_key: str = DEFAULT_TEXT_KEY,
    encoding: str = DEFAULT_ENCODING,
) -> Corpus:
    """Config-facing factory for ``data.corpus`` / ``path`` / ``max_bytes`` / ``text_key`` / ``encoding``."""
    if kind == "stdlib":
        return stdlib_corpus(max_bytes)
    if kind == "text":
        if path is None:
            raise ValueError("data.corpus=text needs data.path=DIR (a directory or file of .txt/.jsonl documents).")
        return text_corpus(path, max_bytes, text_key, encoding)
    raise ValueError(f"Unknown corpus {kind!r}; valid: {', '.join(CORPUS_KINDS)} (data.corpus).")
