"""``PretrainDataModule``: prepared token shards -> one global order -> this rank's micro-batches.

Batches are ``LongTensor[micro_batch_size, seq_len + 1]``; the LightningModule splits them into
inputs ``[:, :-1]`` and labels ``[:, 1:]``. Optimizer step ``k`` trains on the same samples for
every layout (``batches.py``); the data state in a checkpoint is a few counters
(:meth:`state_dict`), so a resume under any layout or worker count continues with exactly the
batch the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit_titan.data.batch_layout import BatchLayout
from lit_titan.data.batches import FixedSampler, GlobalBatches, RankMicroBatches, StepSampler
from lit_titan.data.checks import SHARD_KINDS, check_settings
from lit_titan.data.corpus import Corpus, load_corpus, split_corpus
from lit_titan.data.prepare import prepare_shards
from lit_titan.data.settings import DataConfig, TokenizerConfig
from lit_titan.data.shards import ShardSplit, is_remote
from lit_titan.data.sources import Source, check_tokenizer, data_fingerprint, open_sources, shards_tokenizer
from lit_titan.data.step_ahead import StepAheadLoader
from lit_titan.data.tokenizers import TOKENIZER_KINDS, HFTokenizer, Tokenizer, build_tokenizer, tokenizer_fingerprint
from lit_titan.errors import ConfigError

CACHE_FORMAT_VERSION = 2
STATE_VERSION = 1


def _plain(node: Any) -> dict[str, Any]:
    """A settings dataclass or a mapping (Hydra's, a user's) as a plain dict."""
    return asdict(node) if is_dataclass(node) else dict(node)


class PretrainDataModule(L.LightningDataModule):
    """Causal-LM pre-training batches from documents (prepared on first use) or prepared shards."""

    def __init__(
        self,
        settings: DataConfig | None = None,
        *,
        tokenizer: Mapping[str, Any] | Tokenizer | None = None,
        model_vocab_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        **keys: Any,
    ) -> None:
        """``settings``: the ``data`` group (``DataConfig``); ``keys``: any of its fields, given one by
        one (Hydra's ``_target_`` instantiation, the Python API) over ``settings``. ``tokenizer`` may
        also be a built ``Tokenizer``. The other keywords come from the job, not the data group."""
        super().__init__()
        keys.pop("_target_", None)
        if isinstance(tokenizer, Mapping):
            keys["tokenizer"] = TokenizerConfig(**{**asdict(TokenizerConfig()), **dict(tokenizer)})
        s = self.settings = replace(settings or DataConfig(), **keys)
        self.corpus_kind = s.corpus
        self.path = s.path
        self.seq_len = s.seq_len
        self.global_batch_size = s.global_batch_size
        self._micro_batch_size = s.micro_batch_size
        self.data_dir = Path(s.data_dir).expanduser()
        self.seed = s.seed
        self.num_workers = s.num_workers
        self.pin_memory = s.pin_memory
        self.max_bytes = s.max_bytes
        self.shuffle = s.shuffle
        self.model_vocab_size = model_vocab_size
        self._dp_override = (dp_rank, dp_size)
        self.chunk_tokens = s.chunk_tokens
        self.val_fraction = s.val_fraction
        self.storage_options = dict(s.storage_options) if s.storage_options else None
        self.shuffle_window = s.shuffle_window
        self.document_positions = bool(s.document_positions)
        self.document_masking = bool(s.document_masking)
        self.cross_document_labels = bool(s.cross_document_labels)
        self._source_specs = [_plain(src) for src in s.sources] if s.sources else None
        if tokenizer is None or isinstance(tokenizer, Mapping):
            self._tok_cfg: dict[str, Any] = _plain(s.tokenizer)
            self._tokenizer: Tokenizer | None = None
        else:
            self._tok_cfg = {}
            self._tokenizer = tokenizer
        self._corpus: Corpus | None = None
        self._split: tuple[Corpus, Corpus | None] | None = None
        self._sources: list[Source] | None = None
        self.last_prepare_built = False
        self.timings: dict[str, float] = {}
        self.train_splits: list[ShardSplit] = []
        self.val_split: ShardSplit | None = None
        self.train_batches: GlobalBatches | None = None
        self._resume: dict[str, Any] | None = None
        self._validate_static()

    # ---- validation (cheap; runs before any tokenization or process group) -------------
    def _validate_static(self) -> None:
        check_settings(
            self.corpus_kind,
            self.path,
            self.seq_len,
            self.global_batch_size,
            self._micro_batch_size,
            self.val_fraction,
            self.shuffle_window,
        )
        if self._dp_override[1] is not None:
            self.batch_layout(self._dp_override[1])
        if self.corpus_kind in SHARD_KINDS:
            self._open_shard_sources()
            return
        if self._tokenizer is None:
            kind = self._tok_cfg.get("kind")
            if kind not in TOKENIZER_KINDS:
                raise ConfigError(
                    f"Unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)} (data.tokenizer.kind)."
                )
            if kind == "hf":
                # Loading a tokenizer.json is cheap, and it gives the exact vocab for the check below.
                self._tokenizer = HFTokenizer(self._tok_cfg.get("path") or "")
        self._check_vocab(self._tokenizer.vocab_size if self._tokenizer else int(self._tok_cfg["vocab_size"]))

    def _open_shard_sources(self) -> None:
        if self.corpus_kind == "tokens":
            if not self.path:
                raise ConfigError(
                    "data=tokens needs data.path=DIR or data.path=s3://BUCKET/PREFIX (a prepared "
                    "directory: `lit-titan prepare out=DIR`)"
                )
            specs = [{"path": self.path}]
        else:
            if not self._source_specs:
                raise ConfigError("data=mixture needs data.sources=[{path: DIR, weight: W}, ...]")
            specs = self._source_specs
        kind = self._tok_cfg.get("kind") if self._tokenizer is None else "object"
        if kind not in ("shards", "hf", "object", None):
            raise ConfigError(
                f"data.tokenizer.kind={kind} does not apply to prepared shards (data={self.corpus_kind}): "
                "use kind=shards (the shards' own tokenizer) or kind=hf with the tokenizer.json they "
                "were prepared with"
            )
        self._sources = open_sources(specs, self.storage_options)
        if kind in ("hf", "object"):
            run_tok = self._tokenizer or HFTokenizer(self._tok_cfg.get("path") or "")
            for source in self._sources:
                check_tokenizer(source, run_tok)
            self._tokenizer = run_tok
        self._check_vocab(int(self._sources[0].manifest["tokenizer"]["vocab_size"]))

    def _check_vocab(self, vocab_size: int) -> None:
        if self.model_vocab_size is not None and vocab_size > self.model_vocab_size:
            raise ConfigError(
                f"Tokenizer vocab size {vocab_size} > model vocab size {self.model_vocab_size}: token ids would "
                "index past the embedding. Use a model with a bigger vocab (model vocab_size >= "
                f"{vocab_size}) or a smaller data.tokenizer.vocab_size."
            )

    def batch_layout(self, dp_size: int) -> BatchLayout:
        """Micro-batch and accumulation for ``dp_size`` data-parallel ranks (one line if they do not split).

        Under replica-group fault tolerance every rank loads the whole global batch as one batch: which
        of its samples a rank trains changes when a replica group leaves (lit_titan/fault_tolerance/).
        """
        if self._whole_global_batch():
            return BatchLayout(self.global_batch_size, self.global_batch_size, 1, 1)
        layout = BatchLayout.derive(self.global_batch_size, self._micro_batch_size, dp_size)
        if self._whole_steps():  # the strategy's step runner splits each rank's step into the micro-batches
            return BatchLayout.derive(self.global_batch_size, None, dp_size)
        return layout

    def _strategy(self) -> Any:
        return self.trainer.strategy if self.trainer is not None else None

    def _whole_global_batch(self) -> bool:
        return getattr(self._strategy(), "replica_step", None) is not None

    def _whole_steps(self) -> bool:
        strategy = self._strategy()
        if strategy is None:
            return False
        from lit_titan.strategies.contract import contract

        return contract(strategy).runs_steps

    @property
    def step_micro_batch_size(self) -> int | None:
        """Sequences per micro-batch within a rank's step (``data.micro_batch_size``), for a strategy that
        trains whole steps; None when not set (one micro-batch per step)."""
        if self._micro_batch_size is None:
            return None
        return BatchLayout.derive(self.global_batch_size, self._micro_batch_size, self.data_parallel_coords()[1]).micro

    def ft_micro_batch_size(self, dp_size: int) -> int:
        """The micro-batch a fault-tolerant rank trains its assigned samples in (``data.micro_batch_size``)."""
        return BatchLayout.derive(self.global_batch_size, self._micro_batch_size, dp_size).micro

    # ---- data-parallel coordinates ---------------------------------------------------
    def data_parallel_coords(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: constructor override > strategy's dp attrs > global rank > ``(0, 1)``."""
        rank, size = self._dp_override
        if rank is not None and size is not None:
            return rank, size
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        from lit_titan.strategies.contract import contract

        strategy = contract(trainer.strategy)
        return strategy.data_parallel_rank, strategy.data_parallel_size

    @property
    def micro_batch_size(self) -> int:
        return self.batch_layout(self.data_parallel_coords()[1]).micro

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each dp rank."""
        return self.batch_layout(self.data_parallel_coords()[1]).accumulation

    # ---- documents -> shards (stdlib / text) -------------------------------------------
    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            s = self.settings
            self._corpus = load_corpus(self.corpus_kind, self.path, self.max_bytes, s.text_key, s.encoding)
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
        """The tokenizer: the shards' own (tokens/mixture), or for ``kind=bpe`` trained on first use."""
        return self._resolve_tokenizer(allow_train=True)

    def _resolve_tokenizer(self, allow_train: bool) -> Tokenizer:
        if self._tokenizer is None:
            start = time.perf_counter()
            if self._sources is not None:
                self._tokenizer = shards_tokenizer(self._sources[0], self.data_dir / "chunks")
            else:
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

    def shards_path(self) -> Path:
        """Where the documents' shards are prepared, keyed by both splits' files and the tokenizer."""
        val = self.val_corpus
        key = json.dumps(
            [
                CACHE_FORMAT_VERSION,
                self.train_corpus.fingerprint,
                val.fingerprint if val else None,
                tokenizer_fingerprint(self.tokenizer),
                self.chunk_tokens,
            ]
        )
        return self.data_dir / "shards" / hashlib.sha256(key.encode()).hexdigest()[:16]

    # ---- Lightning hooks -------------------------------------------------------------
    def prepare_data(self) -> None:
        """Prepare the documents into shards once (local rank 0 under Lightning); a no-op when current."""
        self.batch_layout(self.data_parallel_coords()[1])
        self.last_prepare_built = False
        if self.corpus_kind in SHARD_KINDS:
            return
        out = self.shards_path()
        if (out / "manifest.json").is_file():
            return
        start = time.perf_counter()
        prepare_shards(self.train_corpus, self.val_corpus, self.tokenizer, out, chunk_tokens=self.chunk_tokens)
        self.timings["optimize_s"] = time.perf_counter() - start
        self.last_prepare_built = True

    def _resolved_sources(self) -> list[Source]:
        if self._sources is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            self._resolve_tokenizer(allow_train=not distributed)
            out = self.shards_path()
            if not (out / "manifest.json").is_file():
                if distributed:
                    raise RuntimeError(
                        f"Prepared shards {out} are missing on this rank: prepare_data() must run first (Lightning "
                        "runs it on local rank 0); on multi-node without a shared data.data_dir set "
                        "prepare_data_per_node."
                    )
                self.prepare_data()
            return open_sources([{"path": str(out)}], None)
        return self._sources

    def setup(self, stage: str | None = None) -> None:
        """Open the shards (prepared by ``prepare_data``) and check they hold a global batch."""
        dp_rank, dp_size = self.data_parallel_coords()
        layout = self.batch_layout(dp_size)
        micro = layout.micro
        sources = self._resolved_sources()
        cache = self.data_dir / "chunks"
        self.train_splits = [s.split("train", cache) for s in sources]  # type: ignore[misc]
        for source, split in zip(sources, self.train_splits):
            if len(sources) > 1 and int(split.samples_per_chunk(self.seq_len).sum()) == 0:
                raise ConfigError(
                    f"{source.setting}={source.path} holds no sample of data.seq_len+1="
                    f"{self.seq_len + 1} tokens (chunks of {int(split.chunk_tokens.max())} tokens at "
                    "most); lower data.seq_len or prepare with larger chunk_tokens"
                )
        self.weights = [s.weight for s in sources]
        self.source_names = [s.name for s in sources]
        self.fingerprint = data_fingerprint(sources, self.seq_len)
        batches = self._global_batches(step=0, consumed=None)
        sequences = sum(o.per_epoch for o in batches.orders)
        if len(sources) == 1 and sequences < self.global_batch_size:
            # Lightning would end fit() "successfully" with no training batches.
            raise ConfigError(
                f"the corpus yields {sequences} sequences of data.seq_len+1={self.seq_len + 1} tokens, fewer than "
                f"one global batch (data.global_batch_size={self.global_batch_size}); add documents (data.path=DIR, "
                f"data.max_bytes) or lower data.seq_len / data.global_batch_size"
            )
        self.val_split = next((sp for sp in (s.split("val", cache) for s in sources) if sp is not None), None)
        if self.val_split is not None:
            val_samples = int(self.val_split.samples_per_chunk(self.seq_len).sum())
            # Only when validation runs (limit_val_batches > 0): otherwise there is nothing to act on.
            validating = self.trainer is None or bool(getattr(self.trainer, "limit_val_batches", 1))
            if val_samples < dp_size * micro and validating:
                rank_zero_warn(
                    f"The validation split yields {val_samples} sequences, fewer than one validation batch "
                    f"(dp_size x micro_batch_size = {dp_size * micro}): no validation batches. Raise "
                    "data.val_fraction or add documents."
                )
        self._dp = (dp_rank, dp_size)
        self._layout = layout
        self._micro = micro

    def _global_batches(self, step: int, consumed: list[int] | None) -> GlobalBatches:
        return GlobalBatches(
            self.train_splits,
            self.weights,
            seq_len=self.seq_len,
            global_batch=self.global_batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
            window=int(self.shuffle_window),
            step=step,
            consumed=consumed,
        )

    def train_dataloader(self) -> DataLoader:
        if not self.train_splits:
            self.setup("fit")
        step = int(self._resume["step"]) if self._resume else 0
        self.train_batches = self._global_batches(step, self._resume["consumed"] if self._resume else None)
        dp_rank, dp_size = self._dp
        dataset = RankMicroBatches(
            self.train_batches,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch_size=self._micro,
            release_margin_steps=2 + (2 * self.num_workers) // max(1, self._accumulation()),
            positions_eos_id=self._eos_id(),
            documents_eos_id=self._documents_eos_id(),
            ignore_eos_id=self._ignore_eos_id(),
        )
        # One Lightning epoch: the whole run when it is bounded by max_steps, else one pass over the data.
        max_steps = getattr(self.trainer, "max_steps", -1) if self.trainer is not None else -1
        steps = max_steps if max_steps and max_steps > 0 else self.train_batches.steps_per_epoch
        accumulation = self._accumulation()
        loader = self._loader(dataset, StepSampler(step * accumulation, steps * accumulation), StepAheadLoader)
        loader.accumulation = accumulation
        return loader

    def _eos_id(self) -> int | None:
        return self.train_splits[0].eos_id if self.document_positions else None

    def _ignore_eos_id(self) -> int | None:
        masked = self.document_masking and not self.cross_document_labels
        return self.train_splits[0].eos_id if masked else None

    def _documents_eos_id(self) -> int | None:
        return self.train_splits[0].eos_id if self.document_masking else None

    def _accumulation(self) -> int:
        return self._layout.accumulation

    def val_dataloader(self) -> DataLoader | list:
        """Held-out batches, unshuffled, each rank its rows of every ``dp_size * micro`` batch.

        The dp-mean of the rank losses equals the single-process loss on the same rows. Returns
        ``[]`` (Lightning then skips validation) when there is no validation data.
        """
        if not self.train_splits:
            self.setup("validate")
        if self.val_split is None:
            return []
        dp_rank, dp_size = self._dp
        batch = dp_size * self._micro
        batches = GlobalBatches(
            [self.val_split], [1.0], seq_len=self.seq_len, global_batch=batch, seed=0, shuffle=False
        )
        steps = batches.orders[0].per_epoch // batch
        dataset = RankMicroBatches(
            batches,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch_size=self._micro,
            positions_eos_id=self._eos_id(),
            documents_eos_id=self._documents_eos_id(),
            ignore_eos_id=self._ignore_eos_id(),
        )
        return self._loader(dataset, FixedSampler(range(steps)))

    def test_dataloader(self) -> DataLoader | list:
        """The held-out batches of ``val_dataloader``: a corpus split has no third part."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader | list:
        """The held-out batches of ``val_dataloader`` (``predict_step`` gives their logits)."""
        return self.val_dataloader()

    def _loader(self, dataset: RankMicroBatches, sampler: Any, kind: type[DataLoader] = DataLoader) -> DataLoader:
        # Persistent workers: the sampler (and so the order) lives in this process, and a spawned
        # worker (remote data) costs seconds of imports, which a new epoch should not pay again.
        return kind(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self._pin_memory(),
            persistent_workers=self.num_workers > 0,
            multiprocessing_context="spawn" if self.num_workers and is_remote(self.train_splits[0].root) else None,
        )

    def _pin_memory(self) -> bool:
        """``pin_memory``, or by default: whether the batches go to a CUDA device.

        Page-locked batches let Lightning's ``non_blocking`` copy to the GPU overlap compute; with a
        loader worker, torch pins them in a background thread of the training process.
        """
        if self.pin_memory is not None:
            return bool(self.pin_memory)
        if self.trainer is not None:
            from lit_titan.strategies.contract import contract

            return contract(self.trainer.strategy).root_device.type == "cuda"
        return torch.cuda.is_available()

    # ---- exact resume by counter -----------------------------------------------------
    def data_state(self, step: int) -> dict[str, Any]:
        """The data position before global step ``step``: < 1 KiB, layout-independent."""
        batches = self.train_batches or self._global_batches(0, None)
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "step": int(step),
            "consumed": [int(c) for c in batches.blend.consumed_at(step)],
            "fingerprint": self.fingerprint,
            "sources": self.source_names,
        }

    def state_dict(self) -> dict[str, Any]:
        if not self.train_splits or self.trainer is None:
            return {}
        return self.data_state(int(self.trainer.global_step))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if int(state_dict.get("version", 0)) != STATE_VERSION:
            raise ConfigError(
                "this checkpoint's data state comes from an older data pipeline and cannot place the "
                "next batch exactly; resume with the version that wrote it, or start a new run_dir"
            )
        if not self.train_splits:
            self.setup("fit")
        if state_dict["fingerprint"] != self.fingerprint:
            raise ConfigError(
                f"the checkpoint was trained on other data or another data.seq_len (data fingerprint "
                f"{state_dict['fingerprint']}, now {self.fingerprint}: sources {state_dict.get('sources')}, seq_len "
                f"{state_dict.get('seq_len')}); resume with the same data and data.seq_len, or start a new run_dir"
            )
        if int(state_dict["global_batch_size"]) != self.global_batch_size:
            raise ConfigError(
                f"the checkpoint was trained with data.global_batch_size={state_dict['global_batch_size']} (now "
                f"{self.global_batch_size}); the global order depends on it: set it back to resume exactly"
            )
        if int(state_dict["seed"]) != self.seed:
            rank_zero_info(f"resume: seed {state_dict['seed']} -> {self.seed} changes the order of the coming epochs")
        self._resume = dict(state_dict)
