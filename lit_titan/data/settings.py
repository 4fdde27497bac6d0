"""``DataConfig``: the data module's settings, what ``PretrainDataModule`` is built from and the schema's
``data`` group (``conf/data/*.yaml``) in one declaration; the choice lists they accept.

Free of torch on purpose: the config schema imports it before anything heavy is loaded.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from lit_titan.settings import non_empty_str, setting


def _encoding(value: Any) -> str | None:
    """A text codec Python knows, refused when the config is checked rather than when a file is read."""
    try:
        text = getattr(codecs.lookup(value), "_is_text_encoding", True)  # False: base64, zlib, ...
    except (LookupError, TypeError):
        text = False
    return None if text else "not a text encoding Python knows; give one such as utf-8, latin-1 or cp1252"


CORPORA = ("stdlib", "text", "tokens", "mixture")
TOKENIZER_KINDS = ("bpe", "hf", "shards")
DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_TEXT_KEY = "text"
DEFAULT_ENCODING = "utf-8"


@dataclass
class TokenizerConfig:  # data.tokenizer
    """bpe: trained on the corpus; hf: a tokenizer.json at ``path``; shards: the one stored with them."""

    kind: str = setting("bpe", choices=TOKENIZER_KINDS)
    path: str | None = setting(None)
    vocab_size: int | None = setting(8192, ge=1)


@dataclass
class SourceConfig:  # one entry of data.sources (data=mixture)
    path: str = setting(check=non_empty_str)
    weight: float = setting(1.0, gt=0)


@dataclass
class DataConfig:
    """Where the documents are, how they are tokenized, batched and ordered (docs/data.md)."""

    _target_: str = setting("lit_titan.data.PretrainDataModule", check=non_empty_str)  # Hydra's
    corpus: str = setting("stdlib", choices=CORPORA)
    path: str | None = setting(None)
    max_bytes: int | None = setting(DEFAULT_MAX_BYTES, ge=1)
    text_key: str = setting(DEFAULT_TEXT_KEY, check=non_empty_str)  # the field of a .jsonl record holding its text
    encoding: str = setting(DEFAULT_ENCODING, check=_encoding)  # of the .txt/.jsonl files; bytes outside it: an error
    seq_len: int = setting(512, ge=1)
    global_batch_size: int = setting(8, ge=1)
    micro_batch_size: int | None = setting(None, ge=1)
    seed: int = setting(0, ge=0)
    num_workers: int = setting(0, ge=0)
    pin_memory: bool | None = setting(None)
    shuffle: bool = setting(True)
    shuffle_window: int = setting(2048, ge=1)
    chunk_tokens: int = setting(1 << 16, ge=1)
    document_positions: bool = setting(False)
    document_masking: bool = setting(False)
    cross_document_labels: bool = setting(False)
    storage_options: dict[str, Any] | None = setting(None)
    val_fraction: float = setting(0.02, ge=0, lt=1)
    data_dir: str = setting("data_cache", check=non_empty_str)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    sources: list[SourceConfig] | None = setting(None)
