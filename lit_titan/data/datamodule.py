"""``PretrainDataModule``: corpus -> tokenizer -> litdata token chunks -> fixed-length blocks.

Why litdata: ``TokensLoader`` streams ``seq_len + 1`` blocks straight out of memory-mapped
chunks, shuffles deterministically per seed/epoch, and its
``StreamingDataLoader`` has a ``state_dict`` that Lightning stores in the checkpoint, so a
resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
import torch
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.streaming import dataloader as _litdata_dataloader
from litdata.streaming.item_loader import TokensLoader
from litdata.utilities.env import _DistributedEnv

from lit_titan.data.corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus, read_documents, split_corpus
from lit_titan.data.tokenizers import (
    TOKENIZER_KINDS,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    tokenizer_fingerprint,
)

CACHE_FORMAT_VERSION = 1
DEFAULT_TOKENIZER: dict[str, Any] = {"kind": "bpe", "path": None, "vocab_size": 8192}


# --------------------------------------------------------------------------------------
# Layout-independent global order
# --------------------------------------------------------------------------------------
# Core guarantee: the samples of global optimizer step k are the same set for every parallel
# layout (dp size, micro-batch size, gradient accumulation). So the sample order is never
# sharded by litdata: every dp rank streams the *same* global order (litdata pinned to world
# size 1, rank 0; its shuffle then depends only on seed/epoch), reads one global micro-step of
# ``dp_size * micro_batch_size`` blocks per loader batch, and keeps only its own rows
# ``[dp_rank*micro : (dp_rank+1)*micro]``. With global batch G and accumulation
# A = G / (dp*micro), optimizer step k is global samples [k*G, (k+1)*G), micro-step j of it is
# [j*dp*micro, (j+1)*dp*micro), and rank r owns its slice of that.
#
# Trade-off: each rank reads dp x more token blocks than it keeps. They are memory-mapped
# ``seq_len + 1`` int32 slices, so this costs little next to a training step; at very large dp
# a per-rank index sampler over the global order would avoid the extra reads.
#
# With ``num_workers > 1`` torch interleaves the workers' batches round-robin, and litdata gives
# each worker a contiguous range sized in loader batches, so the order then also depends on
# ``(num_workers, dp*micro)``: layouts with the same product (e.g. dp2 x micro2 == dp4 x micro1)
# still match exactly; for full layout independence use ``num_workers <= 1``.
# Epoch end: ``drop_last`` drops the final partial *loader* batch (< dp*micro samples), so the
# last optimizer step of an epoch can be partial, and differ between layouts, when the epoch is
# not a whole number of global batches; every full step before it matches.
class DataParallelStreamingDataset(StreamingDataset):
    """A ``StreamingDataset`` that yields the one global order on every rank.

    litdata shards with ``_DistributedEnv.detect()`` (torch.distributed's global rank/world
    size) and re-detects in ``__iter__``. Here ``distributed_env`` is pinned to world size 1,
    rank 0: a read-only property, so every place litdata reads or re-assigns it sees one
    process, and all ranks (dp ranks and their TP/CP/PP peers alike) stream the same samples;
    the per-rank split happens in the loader's collate (:class:`DataParallelStreamingDataLoader`).
    ``_DistributedEnv`` is private, but it is the only hook litdata offers for this.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._global_env = _DistributedEnv(world_size=1, global_rank=0, num_nodes=1)
        super().__init__(*args, **kwargs)

    @property
    def distributed_env(self) -> _DistributedEnv:  # type: ignore[override]
        return self._global_env

    @distributed_env.setter
    def distributed_env(self, _value: _DistributedEnv) -> None:
        pass  # litdata assigns detected values; the single global stream always wins.


class RankSliceCollate:
    """Stack one global micro-step ``[dp*micro, seq_len + 1]`` and keep this dp rank's rows, as long."""

    def __init__(self, dp_rank: int, micro_batch_size: int) -> None:
        self.start = dp_rank * micro_batch_size
        self.stop = self.start + micro_batch_size

    def __call__(self, items: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(items[self.start : self.stop])).long()


class DataParallelStreamingDataLoader(StreamingDataLoader):
    """Reads ``dp_size * micro_batch_size`` global samples per batch and returns this rank's rows.

    Its ``state_dict`` therefore counts *global* samples, which makes it portable across dp
    sizes / micro-batch sizes: :meth:`load_state_dict` re-labels a checkpoint taken under
    another layout so the next global sample is the first unseen one (see there).
    ``StreamingDataLoader.load_state_dict`` calls ``_DistributedEnv.detect()`` to decide whether
    the world size changed; it is patched to the pinned world size 1, as the dataset sees it.
    """

    dataset: DataParallelStreamingDataset

    def __init__(
        self, dataset: DataParallelStreamingDataset, *, dp_rank: int, dp_size: int, micro_batch_size: int,
        **kwargs: Any,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}.")
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        super().__init__(
            dataset, batch_size=dp_size * micro_batch_size, collate_fn=RankSliceCollate(dp_rank, micro_batch_size),
            **kwargs,
        )

    @contextmanager
    def _pinned_detect(self) -> Iterator[None]:
        env = self.dataset.distributed_env
        with mock.patch.object(_litdata_dataloader._DistributedEnv, "detect", return_value=env):
            yield

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        with self._pinned_detect():
            super().load_state_dict(self._relabel_state(obj))

    def _relabel_state(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Adapt a state saved under another ``dp_size * micro_batch_size`` to this loader.

        With one litdata worker the sample order does not depend on the loader batch size, and
        the stored ``num_samples_yielded`` is a count of global samples; so a different batch
        size only needs the stored ``batch_size`` re-labelled. Otherwise litdata would see a
        "topology change" and switch to its elastic resume, which re-derives a *different*
        canonical order (samples skipped/repeated). The position must be a whole number of this
        loader's global micro-steps (it is whenever the checkpoint sits on an optimizer-step
        boundary, since dp*micro divides the global batch).
        """
        ds = obj.get("dataset")
        if not isinstance(ds, dict) or "batch_size" not in ds:
            return obj
        new_batch, new_workers = int(self.batch_size or 1), max(1, self.num_workers)
        old_batch, old_workers = int(ds["batch_size"]), max(1, int(ds.get("num_workers", 1)))
        if int(ds.get("world_size", 1)) != 1:
            raise ValueError(
                f"This data-loader state was saved by a rank-sharded data pipeline (world_size="
                f"{ds['world_size']}); the current pipeline streams one global order and cannot resume it exactly."
            )
        if (old_batch, old_workers) == (new_batch, new_workers):
            return obj
        position = int(ds["num_samples_yielded"])
        if old_workers > 1 or new_workers > 1:
            raise ValueError(
                f"Cannot resume data-loader state exactly: it was saved with num_workers={old_workers}, "
                f"dp_size*micro_batch_size={old_batch}, now num_workers={new_workers}, dp_size*micro_batch_size="
                f"{new_batch}. With several workers the sample order depends on both; keep them unchanged, or "
                "use data.num_workers <= 1 for layout-independent resume."
            )
        if position % new_batch != 0:
            raise ValueError(
                f"Cannot resume at global sample {position}: not a multiple of dp_size*micro_batch_size="
                f"{new_batch} (resume from a checkpoint taken at an optimizer-step boundary)."
            )
        obj = {**obj, "dataset": {**ds, "batch_size": new_batch, "num_workers": new_workers}}
        obj["num_samples_yielded"] = position
        return obj


def collate_long(items: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack ``[seq_len + 1]`` int32 blocks into one ``[batch, seq_len + 1]`` LongTensor."""
    return torch.stack(list(items)).long()


# --------------------------------------------------------------------------------------
# Token cache
# --------------------------------------------------------------------------------------
class _TokenizeFile:
    """Picklable ``optimize`` fn: one file -> one int32 tensor of its documents, each + eos."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, path: str) -> Iterator[torch.Tensor]:
        ids: list[int] = []
        for doc in read_documents(Path(path)):
            ids.extend(self.tokenizer.encode(doc))
            ids.append(self.tokenizer.eos_id)
        if ids:
            yield torch.tensor(ids, dtype=torch.int32)


def build_token_cache(
    corpus: Corpus, tokenizer: Tokenizer, out_dir: Path, chunk_tokens: int, num_workers: int = 1
) -> None:
    """Tokenize ``corpus`` into litdata chunks at ``out_dir``, atomically.

    Built in a sibling temp dir and renamed into place, so a crash never leaves a cache that
    a later run would trust (its presence == complete). If another process finished first,
    its result is kept.
    """
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        optimize(
            fn=_TokenizeFile(tokenizer),
            inputs=[str(f) for f in corpus.files],
            output_dir=str(tmp),
            chunk_size=chunk_tokens,
            item_loader=TokensLoader(),
            num_workers=num_workers,
            reorder_files=False,  # keep the sorted order: deterministic chunks
            start_method="fork" if os.name == "posix" else None,
            verbose=False,
        )
        meta = {"corpus": str(corpus.root), "files": len(corpus.files), "bytes": corpus.num_bytes}
        (tmp / "lit_titan_cache.json").write_text(json.dumps(meta))
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------
# DataModule
# --------------------------------------------------------------------------------------
class PretrainDataModule(L.LightningDataModule):
    """Causal-LM pre-training batches: ``LongTensor[micro_batch_size, seq_len + 1]``.

    The LightningModule splits each batch into inputs ``[:, :-1]`` and labels ``[:, 1:]``.
    ``val_fraction`` of the document files (chosen by a hash of their corpus-relative path, see
    :func:`~lit_titan.data.corpus.split_corpus`) are held out of training and tokenized into a
    second cache; :meth:`val_dataloader` streams them unshuffled with the same dp slicing, so a
    dp-mean of the per-rank validation losses equals the single-process loss over the same rows.
    All ranks stream one global, layout-independent order; each data-parallel rank (see
    :meth:`data_parallel_coords`) keeps its rows of every global micro-step, so
    tensor/context/pipeline-parallel peers receive identical batches and optimizer step k holds
    the same samples for any dp size / micro-batch size (see the module notes above).
    """

    def __init__(
        self,
        corpus: str = "stdlib",
        path: str | None = None,
        tokenizer: Mapping[str, Any] | Tokenizer | None = None,
        seq_len: int = 512,
        global_batch_size: int = 8,
        micro_batch_size: int | None = None,
        data_dir: str = "data_cache",
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        shuffle: bool = True,
        model_vocab_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        chunk_tokens: int = 1 << 18,
        val_fraction: float = 0.02,
    ) -> None:
        super().__init__()
        self.corpus_kind = corpus
        self.path = path
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self._micro_batch_size = micro_batch_size
        self.data_dir = Path(data_dir).expanduser()
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.max_bytes = max_bytes
        self.shuffle = shuffle
        self.model_vocab_size = model_vocab_size
        self._dp_override = (dp_rank, dp_size)
        self.chunk_tokens = chunk_tokens
        self.val_fraction = val_fraction
        if isinstance(tokenizer, Mapping) or tokenizer is None:
            self._tok_cfg: dict[str, Any] = {**DEFAULT_TOKENIZER, **dict(tokenizer or {})}
            self._tokenizer: Tokenizer | None = None
        else:
            self._tok_cfg = {}
            self._tokenizer = tokenizer
        self._corpus: Corpus | None = None
        self._split: tuple[Corpus, Corpus | None] | None = None
        self.cache_path: Path | None = None
        self.val_cache_path: Path | None = None
        self.last_prepare_built = False
        self.timings: dict[str, float] = {}
        self.train_dataset: DataParallelStreamingDataset | None = None
        self.val_dataset: DataParallelStreamingDataset | None = None
        self._validate_static()

    # ---- validation (cheap; runs before any tokenization) ---------------------------
    def _validate_static(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {self.seq_len}.")
        if self.global_batch_size < 1:
            raise ValueError(f"data.global_batch_size must be >= 1, got {self.global_batch_size}.")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) or not (
            0.0 <= self.val_fraction < 1.0
        ):
            raise ValueError(
                f"data.val_fraction must be a number in [0, 1) (0 disables validation), got {self.val_fraction!r}."
            )
        if self._micro_batch_size is not None and self._micro_batch_size < 1:
            raise ValueError(f"data.micro_batch_size must be >= 1 (or null), got {self._micro_batch_size}.")
        if self.corpus_kind == "text" and self.path is None:
            raise ValueError("data.corpus=text needs data.path=DIR (a directory or file of .txt/.jsonl documents).")
        if self.path is not None and self.corpus_kind == "text" and not Path(self.path).expanduser().exists():
            raise FileNotFoundError(
                f"Corpus path not found: {self.path}. Set data.path=DIR to a directory (or file) of .txt/.jsonl files."
            )
        if self._tokenizer is None:
            kind = self._tok_cfg.get("kind")
            if kind not in TOKENIZER_KINDS:
                raise ValueError(
                    f"Unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)} (data.tokenizer.kind)."
                )
            if kind == "hf":
                # Loading a tokenizer.json is cheap, and it gives the exact vocab for the check below.
                self._tokenizer = HFTokenizer(self._tok_cfg.get("path") or "")
        self._check_vocab(self._tokenizer.vocab_size if self._tokenizer else int(self._tok_cfg["vocab_size"]))
        if self._dp_override[1] is not None:
            self._check_batch_sizes(self._dp_override[1])

    def _check_vocab(self, vocab_size: int) -> None:
        if self.model_vocab_size is not None and vocab_size > self.model_vocab_size:
            raise ValueError(
                f"Tokenizer vocab size {vocab_size} > model vocab size {self.model_vocab_size}: token ids would "
                "index past the embedding. Use a model with a bigger vocab (model vocab_size >= "
                f"{vocab_size}) or a smaller data.tokenizer.vocab_size."
            )

    def _check_batch_sizes(self, dp_size: int) -> int:
        micro = self._micro_batch_size if self._micro_batch_size is not None else self.global_batch_size // dp_size
        if micro < 1 or self.global_batch_size % (dp_size * micro) != 0:
            raise ValueError(
                f"data.global_batch_size={self.global_batch_size} must be a multiple of dp_size ({dp_size}) x "
                f"data.micro_batch_size ({self._micro_batch_size if self._micro_batch_size is not None else micro}); "
                "adjust data.global_batch_size or data.micro_batch_size."
            )
        return micro

    # ---- data-parallel coordinates ---------------------------------------------------
    def data_parallel_coords(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: constructor override > strategy's dp attrs > global rank > ``(0, 1)``."""
        rank, size = self._dp_override
        if rank is not None and size is not None:
            return rank, size
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        strategy = trainer.strategy
        if hasattr(strategy, "data_parallel_rank") and hasattr(strategy, "data_parallel_size"):
            return int(strategy.data_parallel_rank), int(strategy.data_parallel_size)
        return trainer.global_rank, trainer.world_size

    @property
    def micro_batch_size(self) -> int:
        return self._check_batch_sizes(self.data_parallel_coords()[1])

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each dp rank."""
        return self.global_batch_size // (self.data_parallel_coords()[1] * self.micro_batch_size)

    # ---- tokenizer / corpus ----------------------------------------------------------
    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            self._corpus = load_corpus(self.corpus_kind, self.path, self.max_bytes)
        return self._corpus

    def _splits(self) -> tuple[Corpus, Corpus | None]:
        if self._split is None:
            self._split = split_corpus(self.corpus, float(self.val_fraction))
        return self._split

    @property
    def train_corpus(self) -> Corpus:
        """The corpus minus the held-out validation files."""
        return self._splits()[0]

    @property
    def val_corpus(self) -> Corpus | None:
        """The held-out validation files; ``None`` if ``val_fraction == 0`` or the corpus has one file."""
        return self._splits()[1]

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer; for ``kind=bpe`` trained (or loaded from ``data_dir/tokenizers``) on first use."""
        return self._resolve_tokenizer(allow_train=True)

    def _resolve_tokenizer(self, allow_train: bool) -> Tokenizer:
        if self._tokenizer is None:
            start = time.perf_counter()
            self._tokenizer = build_tokenizer(
                kind=self._tok_cfg["kind"],
                path=self._tok_cfg.get("path"),
                vocab_size=int(self._tok_cfg["vocab_size"]),
                corpus=self.train_corpus,  # never sees the validation documents
                cache_dir=self.data_dir / "tokenizers",
                allow_train=allow_train,
            )
            self.timings["tokenizer_s"] = time.perf_counter() - start
            self._check_vocab(self._tokenizer.vocab_size)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _cache_path(self, split: str = "train") -> Path | None:
        """Token cache of ``split`` ("train" / "val"), keyed by that split's files; ``None``: no such data."""
        corpus = self.train_corpus if split == "train" else self.val_corpus
        if corpus is None:
            return None
        key = json.dumps(
            [CACHE_FORMAT_VERSION, split, corpus.fingerprint, tokenizer_fingerprint(self.tokenizer), self.chunk_tokens]
        )
        return self.data_dir / "tokens" / hashlib.sha256(key.encode()).hexdigest()[:16]

    # ---- Lightning hooks -------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the train (and val) token caches once (local rank 0 under Lightning); a no-op when current."""
        self._check_batch_sizes(self.data_parallel_coords()[1])
        self.last_prepare_built = False
        self.cache_path = self._cache_path("train")
        self.val_cache_path = self._cache_path("val")
        for split, path, corpus in (
            ("train", self.cache_path, self.train_corpus),
            ("val", self.val_cache_path, self.val_corpus),
        ):
            if path is None or corpus is None or (path / "index.json").is_file():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            build_token_cache(corpus, self.tokenizer, path, self.chunk_tokens)
            self.timings["optimize_s" if split == "train" else "optimize_val_s"] = time.perf_counter() - start
            self.last_prepare_built = True

    def setup(self, stage: str | None = None) -> None:
        """Open the cache built by ``prepare_data``; never build it concurrently from several ranks."""
        dp_rank, dp_size = self.data_parallel_coords()
        micro = self._check_batch_sizes(dp_size)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._resolve_tokenizer(allow_train=not distributed)
        path, val_path = self._cache_path("train"), self._cache_path("val")
        assert path is not None
        missing = [p for p in (path, val_path) if p is not None and not (p / "index.json").is_file()]
        if missing:
            if distributed:
                raise RuntimeError(
                    f"Token cache {missing[0]} is missing on this rank: prepare_data() must run first (Lightning runs "
                    "it on local rank 0); on multi-node without a shared data.data_dir set prepare_data_per_node."
                )
            self.prepare_data()
        self.cache_path, self.val_cache_path = path, val_path
        self.val_dataset = None
        if val_path is not None:
            # No shuffle: every evaluation (any seed, any epoch, any layout) sees the same rows in the same order.
            self.val_dataset = DataParallelStreamingDataset(
                input_dir=str(val_path),
                item_loader=TokensLoader(block_size=self.seq_len + 1),
                shuffle=False,
                drop_last=True,
            )
            if len(self.val_dataset) < dp_size * micro:
                rank_zero_warn(
                    f"The validation split ({len(self.val_corpus.files) if self.val_corpus else 0} files) yields "
                    f"{len(self.val_dataset)} sequences, fewer than one validation batch (dp_size x micro_batch_size"
                    f" = {dp_size * micro}): no validation batches. Raise data.val_fraction or add documents."
                )
        self.train_dataset = DataParallelStreamingDataset(
            input_dir=str(path),
            item_loader=TokensLoader(block_size=self.seq_len + 1),
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=True,
        )
        sequences = len(self.train_dataset)
        if sequences < self.global_batch_size:
            # Lightning would end fit() "successfully" with no training batches.
            raise ValueError(
                f"the corpus yields {sequences} sequences of data.seq_len+1={self.seq_len + 1} tokens, fewer than "
                f"one global batch (data.global_batch_size={self.global_batch_size}); add documents (data.path=DIR, "
                f"data.max_bytes) or lower data.seq_len / data.global_batch_size"
            )
        self._dp = (dp_rank, dp_size)
        self._micro = micro

    def train_dataloader(self) -> DataParallelStreamingDataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        return self._loader(self.train_dataset)

    def val_dataloader(self) -> DataParallelStreamingDataLoader | list:
        """Held-out batches, unshuffled, sliced per dp rank exactly like training (``drop_last``).

        Every dp rank streams the same order and keeps its ``micro_batch_size`` rows of each
        ``dp_size * micro_batch_size`` global batch, so the dp-mean of the rank losses equals the
        single-process loss on the same rows. Returns ``[]`` (Lightning then skips validation)
        when there is no validation data: ``val_fraction == 0`` or a one-file corpus.
        """
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset)

    def _loader(self, dataset: DataParallelStreamingDataset) -> DataParallelStreamingDataLoader:
        dp_rank, dp_size = self._dp
        return DataParallelStreamingDataLoader(
            dataset,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch_size=self._micro,
            num_workers=self.num_workers,
            drop_last=True,
            pin_memory=self._pin_memory(),
        )

    def _pin_memory(self) -> bool:
        """``pin_memory``, or by default: whether the batches go to a CUDA device.

        Page-locked batches let Lightning's ``non_blocking`` copy to the GPU overlap compute; with a
        loader worker, torch pins them in a background thread of the training process.
        """
        if self.pin_memory is not None:
            return bool(self.pin_memory)
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        if device is not None:
            return device.type == "cuda"
        return torch.cuda.is_available()
