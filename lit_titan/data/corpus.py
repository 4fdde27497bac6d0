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
from dataclasses import dataclass
from pathlib import Path

CORPUS_KINDS = ("stdlib", "text")
TEXT_SUFFIXES = (".txt", ".jsonl")
DEFAULT_MAX_BYTES = 8_000_000
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

    @property
    def num_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def iter_texts(self) -> Iterator[str]:
        """Yield non-empty documents in a fixed order."""
        for f in self.files:
            yield from read_documents(f)


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
                        f"{path}:{lineno} is not a JSON object with a 'text' field ({e}); fix the file or "
                        "point data.path=DIR at .txt/.jsonl files."
                    ) from e
                if str(text).strip():
                    yield str(text)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():  # whitespace-only files are empty documents
            yield text


def _cap(files: list[Path], max_bytes: int | None) -> list[Path]:
    """Keep the sorted prefix that fits in ``max_bytes`` (always at least one file)."""
    if max_bytes is None:
        return files
    kept: list[Path] = []
    total = 0
    for f in files:
        size = f.stat().st_size
        if kept and total + size > max_bytes:
            break
        kept.append(f)
        total += size
    return kept


def stdlib_corpus(max_bytes: int | None = DEFAULT_MAX_BYTES) -> Corpus:
    """The running interpreter's standard library ``.py`` sources: always present, nothing to download."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = sorted(
        (p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts) and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    return _checked(Corpus("stdlib", root, tuple(_cap(files, max_bytes)), max_bytes), "the Python stdlib")


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
    return _checked(Corpus("text", root, tuple(_cap(files, max_bytes)), max_bytes), str(root))


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


def load_corpus(kind: str, path: str | os.PathLike[str] | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> Corpus:
    """Config-facing factory for ``data.corpus`` / ``data.path`` / ``data.max_bytes``."""
    if kind == "stdlib":
        return stdlib_corpus(max_bytes)
    if kind == "text":
        if path is None:
            raise ValueError("data.corpus=text needs data.path=DIR (a directory or file of .txt/.jsonl documents).")
        return text_corpus(path, max_bytes)
    raise ValueError(f"Unknown corpus {kind!r}; valid: {', '.join(CORPUS_KINDS)} (data.corpus).")
