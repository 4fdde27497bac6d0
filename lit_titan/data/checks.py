"""The data settings' own checks: cheap, pure, run before any tokenization or process group.

Kept apart from the data module so that the checks read as one list and the module stays about
what it builds.
"""

from __future__ import annotations

from pathlib import Path

from lit_titan.errors import ConfigError

DOCUMENT_KINDS = ("stdlib", "text")
SHARD_KINDS = ("tokens", "mixture")


def check_settings(
    corpus_kind: str,
    path: str | None,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int | None,
    val_fraction: float,
    shuffle_window: int,
) -> None:
    """Refuse a bad ``data.*`` value with one line naming the key."""
    if seq_len < 1:
        raise ConfigError(f"data.seq_len must be >= 1, got {seq_len}.")
    if global_batch_size < 1:
        raise ConfigError(f"data.global_batch_size must be >= 1, got {global_batch_size}.")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction must be a number in [0, 1) (0 disables validation), got {val_fraction!r}."
        )
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"data.micro_batch_size must be >= 1 (or null), got {micro_batch_size}.")
    if int(shuffle_window) < 1:
        raise ConfigError(f"data.shuffle_window must be >= 1 sample, got {shuffle_window}.")
    if corpus_kind not in DOCUMENT_KINDS + SHARD_KINDS:
        raise ConfigError(f"data.corpus={corpus_kind!r} is not one of {', '.join(DOCUMENT_KINDS + SHARD_KINDS)}")
    if corpus_kind == "text" and path is None:
        raise ConfigError("data.corpus=text needs data.path=DIR (a directory or file of .txt/.jsonl documents).")
    if path is not None and corpus_kind == "text" and not Path(path).expanduser().exists():
        raise FileNotFoundError(
            f"Corpus path not found: {path}. Set data.path=DIR to a directory (or file) of .txt/.jsonl files."
        )
