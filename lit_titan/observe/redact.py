"""Credentials out of everything a run writes or prints: the one place that decides what is secret.

A run's config may carry credentials (``data.storage_options.aws_secret_access_key``, a mixture
source's ``storage_options``, a logger's ``settings.api_key``); the running job needs them, its
records must not hold them: config.yaml, Hydra's ``.hydra/`` record and ``multirun.yaml``, the
printed continue command, and what third-party loggers copy (W&B records the command line).

Two rules, applied together: a value whose *key* names a credential (:func:`is_secret_key`) is
replaced by ``***``; and every string anywhere (an override line, Hydra's ``override_dirname``, a
command) has each such value replaced by ``***``, so a secret is caught in whatever form it is
copied (the override ``data.storage_options={...,aws_secret_access_key:'X'}`` is a plain string).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MASK = "***"

# A key naming a credential: words joined by _ or -, case-insensitive. "token" as a word only
# (``hf_token``, ``session_token``), so ``chunk_tokens`` and ``tokenizer`` are not hidden.
_SECRET_KEY = re.compile(
    r"secret|passw(or)?d|credential|api[_-]?key|private[_-]?key|access[_-]?key|auth"
    r"|(^|[_-])token($|[_-])|(^|[_-])key($|[_-])",
    re.IGNORECASE,
)
# Shorter values are not scrubbed from free text (they would mask common words); their keys still are.
_MIN_SCRUB_CHARS = 4


def is_secret_key(name: object) -> bool:
    """``aws_secret_access_key``, ``aws_access_key_id``, ``key``, ``api_key``, ``hf_token``, ``password``... -> True."""
    return isinstance(name, str) and bool(_SECRET_KEY.search(name))


def _plain(obj: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(obj, resolve=True, throw_on_missing=False)
        except Exception:  # noqa: BLE001 - an interpolation that resolves only in its job: keep it as written
            return OmegaConf.to_container(obj, resolve=False)
    return obj


def secrets_of(*sources: Any) -> frozenset[str]:
    """The credential values in configs (dict/DictConfig) and override lists (``key=value`` strings)."""
    found: set[str] = set()

    def walk(obj: Any, secret: bool) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, secret or is_secret_key(k))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, secret)
        elif secret and obj is not None and not isinstance(obj, bool):
            found.add(str(obj))

    for source in sources:
        source = _plain(source)
        if isinstance(source, (list, tuple)) and all(isinstance(o, str) for o in source):
            for line in source:
                walk(_override_value(line), False)
        else:
            walk(source, False)
    return frozenset(s for s in found if s and s != MASK)


def _override_value(line: str) -> Any:
    """``a.b.aws_secret_access_key=X`` -> {"aws_secret_access_key": "X"}; a dict value as parsed by Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(line)
        return {override.key_or_group.split(".")[-1]: override.value()}
    except Exception:  # noqa: BLE001 - not an override (a notebook's or pytest's argv): read it as key=value
        key, sep, value = line.partition("=")
        return {key.lstrip("+~").split(".")[-1]: value} if sep else None


def redact(obj: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of ``obj`` (a config, a list, a string) fit to write or print: credentials as ``***``.

    ``secrets``: values to scrub from every string besides those found under credential keys of
    ``obj`` itself (e.g. the run's :func:`secrets_of`, for a record that holds only override lines).
    """
    obj = _plain(obj)
    values = sorted(set(secrets) | secrets_of(obj), key=len, reverse=True)  # longest first: no partial masks
    values = [v for v in values if len(v) >= _MIN_SCRUB_CHARS]

    def text(s: str) -> str:
        for v in values:
            s = s.replace(v, MASK)
        return s

    def walk(o: Any) -> Any:
        if isinstance(o, Mapping):
            return {
                k: (MASK if is_secret_key(k) and v is not None and not isinstance(v, (Mapping, list)) else walk(v))
                for k, v in o.items()
            }
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        if isinstance(o, str):
            return text(o)
        return o

    return walk(obj)


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (0600; the directory is not changed).

    For the run's records (config.yaml, .hydra/): they name data paths, buckets and endpoints.
    Created with the mode (no window in which another user can open it), replaced atomically.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # O_CREAT's mode is not applied to a file left by an earlier crash
    os.replace(tmp, path)
    return path


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and parents) and make it readable by its owner only (0700)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
