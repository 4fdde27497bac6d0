"""Tokenizers: one small interface, two ways to get a HF ``tokenizers`` model behind it.

Why an interface: the datamodule and the model only need ``encode``/``decode``, the vocab
size and the special ids, so a real Llama 3.1 ``tokenizer.json`` and a tiny BPE trained
offline on the corpus itself are interchangeable.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|end_of_text|>"
BOS_TOKEN = "<|begin_of_text|>"
TOKENIZER_KINDS = ("hf", "bpe")
# Byte-level BPE needs the 256 byte symbols plus the special tokens.
MIN_BPE_VOCAB = 256 + 2


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A ``tokenizer.json`` loaded with HF ``tokenizers`` (the format Llama 3.1 ships).

    ``encode`` adds no special tokens: the datamodule appends ``eos_id`` after every
    document itself, so document boundaries do not depend on the file's post-processor.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(
                f"Tokenizer file not found: {self.path}. "
                "Set data.tokenizer.path=... to an existing tokenizer.json "
                "(or use data.tokenizer.kind=bpe to train a small one on the corpus)."
            )
        self._tok = _HFTokenizerModel.from_file(str(self.path))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: int = self._special_id(EOS_TOKEN, "</s>", "<|endoftext|>", "<eos>", required=True)  # type: ignore[assignment]
        self.bos_id: int | None = self._special_id(BOS_TOKEN, "<s>", "<bos>", required=False)

    def _special_id(self, *names: str, required: bool) -> int | None:
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        if required:
            raise ValueError(
                f"{self.path} has none of the end-of-text tokens {names}; "
                f"add {EOS_TOKEN!r} as a special token or point data.tokenizer.path at another tokenizer.json."
            )
        return None

    @property
    def fingerprint(self) -> str:
        """Content hash: a token cache must change when the vocabulary does, not when the path does."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A stable identity for cache keys; falls back to probing for tokenizers without ``fingerprint``."""
    fp = getattr(tokenizer, "fingerprint", None)
    if isinstance(fp, str):
        return fp
    probe = tokenizer.encode("def main():\n    return 'Hello, world!'  # 0123 ünï\n")
    payload = json.dumps([type(tokenizer).__qualname__, tokenizer.vocab_size, tokenizer.eos_id, probe])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _inputs_key(inputs: Any) -> str:
    """Hash the training inputs cheaply: file metadata for files, content for raw strings."""
    fp = getattr(inputs, "fingerprint", None)
    if isinstance(fp, str):  # a Corpus: paths + sizes + mtimes
        return fp
    h = hashlib.sha256()
    for item in inputs:
        if isinstance(item, Path):
            st = item.stat()
            h.update(f"file:{item.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        else:
            h.update(b"text:" + hashlib.sha256(str(item).encode()).digest())
    return h.hexdigest()[:16]


def _iter_texts(inputs: Any) -> Iterator[str]:
    iter_texts = getattr(inputs, "iter_texts", None)
    if callable(iter_texts):
        yield from iter_texts()
        return
    for item in inputs:
        if isinstance(item, Path):
            yield item.read_text(encoding="utf-8", errors="replace")
        else:
            yield str(item)


def _bounded(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Stop after ``max_bytes`` so training stays a few seconds regardless of corpus size."""
    seen = 0
    for text in texts:
        if seen >= max_bytes:
            return
        text = text[: max_bytes - seen]
        seen += len(text.encode("utf-8", errors="replace"))
        yield text


def bpe_tokenizer_path(
    texts_or_files: Any, vocab_size: int, cache_dir: str | os.PathLike[str], max_train_bytes: int = 4_000_000
) -> Path:
    """Where :func:`train_bpe_tokenizer` caches the tokenizer for these inputs (without training it)."""
    key = hashlib.sha256(f"bpe-v1:{_inputs_key(texts_or_files)}:{vocab_size}:{max_train_bytes}".encode()).hexdigest()
    return Path(cache_dir) / f"bpe-{vocab_size}-{key[:16]}" / "tokenizer.json"


def train_bpe_tokenizer(
    texts_or_files: Any,
    vocab_size: int,
    cache_dir: str | os.PathLike[str],
    max_train_bytes: int = 4_000_000,
    allow_train: bool = True,
) -> HFTokenizer:
    """Train (or load from cache) a byte-level BPE on the corpus itself, for offline runs.

    ``texts_or_files``: a ``Corpus`` (anything with ``fingerprint`` and ``iter_texts()``), or a
    sequence whose ``Path`` items are files and ``str`` items are texts. The cache key hashes
    the inputs, ``vocab_size`` and ``max_train_bytes``, so the tokenizer is retrained only when
    one of them changes. The file is written atomically, so concurrent callers never read a
    half-written tokenizer. ``allow_train=False`` only loads (for non-zero ranks, which must
    not train their own, possibly different, copy).
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"BPE vocab_size={vocab_size} is too small for a byte-level BPE; "
            f"set data.tokenizer.vocab_size >= {MIN_BPE_VOCAB}."
        )
    out = bpe_tokenizer_path(texts_or_files, vocab_size, cache_dir, max_train_bytes)
    if out.is_file():
        return HFTokenizer(out)
    if not allow_train:
        raise FileNotFoundError(
            f"Trained tokenizer {out} is missing on this rank: prepare_data() (local rank 0) trains it; "
            "on multi-node without a shared data.data_dir set prepare_data_per_node=True."
        )

    tok = _HFTokenizerModel(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_bounded(_iter_texts(texts_or_files), max_train_bytes), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, out)
    return HFTokenizer(out)


def build_tokenizer(
    kind: str,
    path: str | None,
    vocab_size: int,
    corpus: Any,
    cache_dir: str | os.PathLike[str],
    allow_train: bool = True,
) -> Tokenizer:
    """Config-facing factory: ``kind="hf"`` loads ``path``; ``kind="bpe"`` trains on ``corpus``."""
    if kind == "hf":
        if not path:
            raise ValueError("data.tokenizer.kind=hf needs data.tokenizer.path=... pointing at a tokenizer.json.")
        return HFTokenizer(path)
    if kind == "bpe":
        return train_bpe_tokenizer(corpus, vocab_size, cache_dir, allow_train=allow_train)
    raise ValueError(
        f"Unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)} (data.tokenizer.kind)."
    )
