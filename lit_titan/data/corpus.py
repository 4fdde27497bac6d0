"""Corpora: a deterministic, sorted list of document files.

Why files rather than texts: file paths + sizes + mtimes give a cheap fingerprint, so caches
(tokenizer, token chunks) can be validated without reading the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from lit_titan.data.settings import DEFAULT_MAX_BYTES

CORPUS_KINDS = ("stdlib", "text")
TEXT_SUFFIXES = (".txt", ".jsonl")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """Sorted document files; ``.jsonl`` files hold one document per line (its ``text`` field)."""

    kind: str
    root: Path
    files: tuple[Path, ...]
    max_bytes: int | None = None

    @property
    def fingerprint(self) -> str:
        """Hash of (kind, relative paths, sizes, mtimes, max_bytes): changes iff the inputs do."""
        h = hashlib.sha256(f"{self.kind}:{self.root}:{self.max_bytes}\n".encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]

    def iter_texts(self) -> Iterator[str]:
        """Yield non-empty documents in a fixed order."""
        for f in self.files:
            yield from read_documents(f)


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


def read_documents(path: Path) -> Iterator[str]:
    """Documents of one file: the whole file, or each ``text`` field of a ``.jsonl``."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get("text", "")
                except (json.JSONDecodeError, AttributeError) as e:
                    raise ValueError(
                        f"{path}:{lineno}: not a JSON object with a 'text' field ({e}); fix or remove that line"
                    ) from e
                if str(text).strip():
                    yield str(text)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():  # whitespace-only files are empty documents
            yield text


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


def stdlib_corpus(max_bytes: int | None = DEFAULT_MAX_BYTES) -> Corpus:
    """The running interpreter's standard library ``.py`` sources: always present, nothing to download."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = sorted(
        (p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts) and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    return _checked(Corpus("stdlib", root, tuple(_cap(files, max_bytes, root)), max_bytes), "the Python stdlib")


def text_corpus(path: str | os.PathLike[str], max_bytes: int | None = None) -> Corpus:
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
    return _checked(Corpus("text", root, tuple(_cap(files, max_bytes, root)), max_bytes), str(root))


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
    kind: str, path: str | os.PathLike[str] | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES
) -> Corpus:
    """Config-facing factory for ``data.corpus`` / ``data.path`` / ``data.max_bytes``."""
    if kind == "stdlib":
        return stdlib_corpus(max_bytes)
    if kind == "text":
        if path is None:
            raise ValueError("data.corpus=text needs data.path=DIR (a directory or file of .txt/.jsonl documents).")
        return text_corpus(path, max_bytes)
    raise ValueError(f"Unknown corpus {kind!r}; valid: {', '.join(CORPUS_KINDS)} (data.corpus).")
