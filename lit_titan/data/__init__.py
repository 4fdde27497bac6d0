"""Data pipeline: corpora, tokenizers and the pre-training ``LightningDataModule``."""

from lit_titan.data.corpus import Corpus, load_corpus, split_corpus, stdlib_corpus, text_corpus
from lit_titan.data.datamodule import (
    DataParallelStreamingDataLoader,
    DataParallelStreamingDataset,
    PretrainDataModule,
    build_token_cache,
)
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
    "Corpus",
    "DataParallelStreamingDataLoader",
    "DataParallelStreamingDataset",
    "HFTokenizer",
    "PretrainDataModule",
    "Tokenizer",
    "build_token_cache",
    "build_tokenizer",
    "load_corpus",
    "split_corpus",
    "stdlib_corpus",
    "text_corpus",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
]
