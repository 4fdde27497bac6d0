"""Data pipeline: documents -> prepared token shards -> one global order -> each rank's micro-batches.

Modules, in data-flow order: ``corpus`` and ``tokenizers`` (documents), ``prepare`` (shards and
their manifest), ``shards`` (reading a split, local or S3), ``sources`` (checked config), ``order``
(one source's sample order), ``mixture`` (per-batch source counts), ``batches`` (global batches
and rank slices), ``datamodule`` (the Lightning face). Design notes: ``docs/data.md``.
"""

from lit_titan.data.batches import GlobalBatches, RankMicroBatches, StepSampler
from lit_titan.data.corpus import Corpus, load_corpus, split_corpus, stdlib_corpus, text_corpus
from lit_titan.data.datamodule import PretrainDataModule
from lit_titan.data.mixture import Blend
from lit_titan.data.order import SourceOrder
from lit_titan.data.prepare import prepare_shards
from lit_titan.data.shards import ShardSplit
from lit_titan.data.tokenizers import (
    EOS_TOKEN,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)

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
