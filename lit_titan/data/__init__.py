"""Data pipeline: documents -> prepared token shards -> one global order -> each rank's micro-batches.

Modules, in data-flow order: ``corpus`` and ``tokenizers`` (documents), ``prepare`` (shards and
their manifest), ``shards`` (reading a split, local or S3), ``sources`` (checked config), ``order``
(one source's sample order), ``mixture`` (per-batch source counts), ``batches`` (global batches
and rank slices), ``datamodule`` (the Lightning face). Design notes: ``docs/data.md``.
"""

import importlib
from typing import Any

# Loaded on first use (PEP 562), so that the torch-free ``lit_titan.data.settings`` (the schema's
# ``data`` group) can be imported by ``--help`` without loading torch and Lightning.
_HOMES = {
    "GlobalBatches": "batches",
    "RankMicroBatches": "batches",
    "StepSampler": "batches",
    "Corpus": "corpus",
    "load_corpus": "corpus",
    "split_corpus": "corpus",
    "stdlib_corpus": "corpus",
    "text_corpus": "corpus",
    "PretrainDataModule": "datamodule",
    "Blend": "mixture",
    "SourceOrder": "order",
    "prepare_shards": "prepare",
    "ShardSplit": "shards",
    "EOS_TOKEN": "tokenizers",
    "HFTokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
    "tokenizer_fingerprint": "tokenizers",
    "train_bpe_tokenizer": "tokenizers",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = [
    "EOS_TOKEN",
    "Blend",
    "Corpus",
    "GlobalBatches",
    "HFTokenizer",
    "PretrainDataModule",
    "RankMicroBatches",
    "ShardSplit",
    "SourceOrder",
    "StepSampler",
    "Tokenizer",
    "build_tokenizer",
    "load_corpus",
    "prepare_shards",
    "split_corpus",
    "stdlib_corpus",
    "text_corpus",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
]
