"""Tests for lit_titan.data: determinism, layout-independent order, resume, caching, bad input (CPU, fast)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lit_titan.data import (
    EOS_TOKEN,
    HFTokenizer,
    PretrainDataModule,
    Tokenizer,
    build_tokenizer,
    load_corpus,
    split_corpus,
    text_corpus,
    train_bpe_tokenizer,
)
from lit_titan.data.corpus import Corpus, val_hash

SMALL = 300_000
TOK = {"kind": "bpe", "vocab_size": 1024}
SEQ = 64


def make_dm(data_dir: Path, **kw: Any) -> PretrainDataModule:
    args: dict[str, Any] = dict(
        corpus="stdlib", tokenizer=TOK, seq_len=SEQ, global_batch_size=4, data_dir=str(data_dir), max_bytes=SMALL
    )
    args.update(kw)
    return PretrainDataModule(**args)


def batches(dm: PretrainDataModule, n: int | None = None) -> list[torch.Tensor]:
    dm.setup("fit")
    out = []
    for i, b in enumerate(dm.train_dataloader()):
        if n is not None and i >= n:
            break
        out.append(b)
    return out


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One shared cache (tokenizer + token chunks) for the whole file."""
    d = tmp_path_factory.mktemp("data")
    dm = make_dm(d)
    dm.prepare_data()
    assert dm.last_prepare_built
    return d


@pytest.fixture(autouse=True)
def _no_dist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "GLOBAL_RANK", "NNODES"):
        monkeypatch.delenv(var, raising=False)


# ---- batches --------------------------------------------------------------------------
def test_batch_format_and_eos(data_dir: Path) -> None:
    dm = make_dm(data_dir)
    (b,) = batches(dm, 1)
    assert b.dtype == torch.long and b.shape == (4, SEQ + 1)
    assert dm.micro_batch_size == 4 and dm.grad_accum_steps == 1
    assert dm.vocab_size == dm.tokenizer.vocab_size <= 1024
    assert 0 <= int(b.min()) and int(b.max()) < dm.vocab_size
    # every document is followed by eos: the cache holds one eos per stdlib file
    eos = dm.tokenizer.eos_id
    all_tokens = torch.cat([x.flatten() for x in batches(make_dm(data_dir, shuffle=False))])
    assert int((all_tokens == eos).sum()) > 0


def test_deterministic_per_seed(data_dir: Path) -> None:
    a = batches(make_dm(data_dir, seed=1), 2)
    b = batches(make_dm(data_dir, seed=1), 2)
    c = batches(make_dm(data_dir, seed=2), 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def _trainer(global_rank: int, world_size: int, tp: int | None) -> Any:
    """A trainer whose strategy is Lightning's DDP (every rank a data-parallel rank), or TitanStrategy
    with tensor parallel ``tp`` (its data-parallel coordinates come from the layout)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from lit_titan.strategies import TitanStrategy
    from lit_titan.strategies.parallel_dims import ParallelDims

    env = LightningEnvironment()
    env.set_global_rank(global_rank)
    env.set_world_size(world_size)
    if tp is None:
        strategy = DDPStrategy(cluster_environment=env)
    else:
        strategy = TitanStrategy(tp=tp)
        strategy.cluster_environment = env
        strategy.parallel_dims = ParallelDims.resolve(world_size, tp=tp)
    strategy.parallel_devices = [torch.device("cpu")]  # this process's device (local rank 0)
    return SimpleNamespace(strategy=strategy)


def test_dp_coords_resolution(data_dir: Path) -> None:
    dm = make_dm(data_dir)
    assert dm.data_parallel_coords() == (0, 1)
    dm.trainer = _trainer(3, 4, None)
    assert dm.data_parallel_coords() == (3, 4)
    dm.trainer = _trainer(3, 4, tp=2)
    assert dm.data_parallel_coords() == (1, 2)
    assert make_dm(data_dir, dp_rank=0, dp_size=4).data_parallel_coords() == (0, 4)


def _step_rows(per_rank: list[list[torch.Tensor]], accum: int, step: int) -> torch.Tensor:
    """Rows of optimizer step ``step``: dp ranks in rank order, each its micro-batches in order."""
    return torch.cat([torch.cat([b[step * accum + j] for j in range(accum)]) for b in per_rank])


def _rank_batches(data_dir: Path, dp: int, micro: int, n: int | None = None, **kw: Any) -> list[list[torch.Tensor]]:
    return [batches(make_dm(data_dir, micro_batch_size=micro, dp_rank=r, dp_size=dp, **kw), n) for r in range(dp)]


@pytest.mark.parametrize("dp", [2, 4])
def test_global_order_independent_of_layout(data_dir: Path, dp: int) -> None:
    """dp x micro 2 with accumulation == one rank with micro 8: same rows in every optimizer step."""
    G, micro = 8, 2
    accum = G // (dp * micro)
    ref = batches(make_dm(data_dir, seed=3, global_batch_size=G, micro_batch_size=G))
    per_rank = _rank_batches(data_dir, dp, micro, seed=3, global_batch_size=G)
    dm = make_dm(data_dir, global_batch_size=G, micro_batch_size=micro, dp_rank=0, dp_size=dp)
    assert dm.grad_accum_steps == accum
    assert len(ref) > 10 and all(b.shape == (micro, SEQ + 1) and b.dtype == torch.long for b in per_rank[0])
    assert all(len(b) >= len(ref) * accum for b in per_rank)  # the whole epoch, not just a prefix
    for k in range(len(ref)):
        assert torch.equal(_step_rows(per_rank, accum, k), ref[k]), f"optimizer step {k} differs (dp={dp})"
    # the ranks split each micro-step: no row is read twice
    rows = [tuple(r.tolist()) for b in per_rank for x in b[: len(ref) * accum] for r in x]
    assert len(set(rows)) == len(rows) == len(ref) * G


def test_dp_peers_identical(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 global ranks, dp_size=2 (e.g. TP=2): ranks {0,1} -> dp 0, {2,3} -> dp 1; under TitanStrategy each batch is
    the rank's whole step (its step runner makes the micro-batches of 2)."""
    per_rank = []
    for rank in range(4):
        # What litdata would detect on this process: the *global* rank/world size (must be ignored).
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        dm = make_dm(data_dir, global_batch_size=8, micro_batch_size=2)
        dm.trainer = _trainer(rank, 4, tp=2)
        per_rank.append(batches(dm, 6))
        assert dm.grad_accum_steps == 1 and dm.step_micro_batch_size == 2 and per_rank[-1][0].shape[0] == 4
    assert len(per_rank[0]) == 6
    for peer_a, peer_b in ((0, 1), (2, 3)):
        assert all(torch.equal(x, y) for x, y in zip(per_rank[peer_a], per_rank[peer_b], strict=True))
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("GLOBAL_RANK")
    ref = batches(make_dm(data_dir, global_batch_size=8, micro_batch_size=8), 6)
    for k in range(6):
        assert torch.equal(_step_rows([per_rank[0], per_rank[2]], 1, k), ref[k])


def test_batch_size_validation(data_dir: Path) -> None:
    dm = make_dm(data_dir, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2)
    assert dm.grad_accum_steps == 2 and dm.micro_batch_size == 2
    with pytest.raises(ValueError, match="data.global_batch_size.*data.micro_batch_size"):
        make_dm(data_dir, global_batch_size=6, micro_batch_size=4, dp_rank=0, dp_size=1)
    dm = make_dm(data_dir, global_batch_size=4, micro_batch_size=2)
    dm.trainer = _trainer(0, 4, tp=1)
    with pytest.raises(ValueError, match="data.micro_batch_size"):
        dm.setup("fit")


# ---- resume ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_continues_with_next_batch(data_dir: Path, num_workers: int) -> None:
    k = 3
    reference = batches(make_dm(data_dir, num_workers=num_workers), k + 2)
    dm = make_dm(data_dir, num_workers=num_workers)
    dm.setup("fit")
    state = dm.data_state(k)  # what a checkpoint after k optimizer steps holds
    assert len(json.dumps(state)) < 1024 and state["consumed"] == [k * 4]
    dm2 = make_dm(data_dir, num_workers=num_workers)
    dm2.load_state_dict(state)
    it = iter(dm2.train_dataloader())
    assert torch.equal(next(it), reference[k]) and torch.equal(next(it), reference[k + 1])


def _loader(data_dir: Path, dp: int, micro: int, rank: int = 0, state: dict | None = None, **kw: Any) -> Any:
    dm = make_dm(data_dir, global_batch_size=8, micro_batch_size=micro, dp_rank=rank, dp_size=dp, **kw)
    if state is not None:
        dm.load_state_dict(copy.deepcopy(state))
    dm.setup("fit")
    return dm.train_dataloader()


def test_resume_across_dp_layouts(data_dir: Path) -> None:
    """k optimizer steps at dp2 x micro2 (accum 2); resume at dp1 x micro8, dp4 x micro2, dp1 x micro4 + 2 workers."""
    k = 3
    ref = batches(make_dm(data_dir, global_batch_size=8, micro_batch_size=8), k + 2)
    states = []
    for rank in range(2):
        dm = make_dm(data_dir, global_batch_size=8, micro_batch_size=2, dp_rank=rank, dp_size=2)
        dm.setup("fit")
        states.append(dm.data_state(k))
    assert states[0] == states[1]  # every dp rank holds the same (global) position

    def next_step(dp: int, micro: int, accum: int, **kw: Any) -> torch.Tensor:
        per_rank = []
        for rank in range(dp):
            it = iter(_loader(data_dir, dp, micro, rank, states[0], **kw))
            per_rank.append([next(it) for _ in range(accum)])
        return _step_rows(per_rank, accum, 0)

    assert torch.equal(next_step(1, 8, 1), ref[k])
    assert torch.equal(next_step(4, 2, 1), ref[k])
    assert torch.equal(next_step(1, 4, 2, num_workers=2), ref[k])
    it = iter(_loader(data_dir, 1, 8, state=states[0]))
    assert torch.equal(next(it), ref[k]) and torch.equal(next(it), ref[k + 1])


def test_resume_refuses_other_data(data_dir: Path, tmp_path: Path) -> None:
    dm = make_dm(data_dir, global_batch_size=8)
    dm.setup("fit")
    state = dm.data_state(2)
    with pytest.raises(ValueError, match=r"other data or another data\.seq_len"):
        _loader(data_dir, 1, 8, state=state, seq_len=SEQ // 2)
    with pytest.raises(ValueError, match=r"data\.global_batch_size=8"):
        make_dm(data_dir, global_batch_size=16).load_state_dict(copy.deepcopy(state))
    with pytest.raises(ValueError, match="older data pipeline"):
        make_dm(data_dir).load_state_dict({"loops": 1})


class _TinyLM(L.LightningModule):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.head(self.emb(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(data_dir: Path, max_steps: int, root: Path, ckpt_path: str | None = None, every: int | None = None) -> list:
    dm = make_dm(data_dir)
    model = _TinyLM(1024)
    callbacks = []
    if every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


def test_lightning_checkpoint_resume(data_dir: Path, tmp_path: Path) -> None:
    full = _fit(data_dir, 6, tmp_path / "full")
    first = _fit(data_dir, 3, tmp_path / "a", every=3)
    ckpts = sorted((tmp_path / "a").glob("*.ckpt"))
    assert ckpts, "ModelCheckpoint wrote nothing"
    data_state = torch.load(ckpts[-1], weights_only=False)["PretrainDataModule"]
    assert data_state["step"] == 3 and data_state["consumed"] == [3 * 4]  # 3 steps x global batch 4
    resumed = _fit(data_dir, 6, tmp_path / "b", ckpt_path=str(ckpts[-1]))
    assert len(first) == 3 and len(resumed) == 3
    for got, want in zip(first + resumed, full):
        assert torch.equal(got, want)


# ---- caching --------------------------------------------------------------------------
def test_token_cache_reused(data_dir: Path) -> None:
    dm = make_dm(data_dir)
    dm.prepare_data()
    assert not dm.last_prepare_built
    index = dm.shards_path() / "manifest.json"
    mtime = index.stat().st_mtime_ns
    dm2 = make_dm(data_dir)
    dm2.prepare_data()
    assert not dm2.last_prepare_built and index.stat().st_mtime_ns == mtime
    # setup() on a fresh module (other ranks) finds the cache and the trained tokenizer
    dm3 = make_dm(data_dir)
    dm3.setup("fit")
    assert dm3.shards_path() == dm.shards_path() and dm3.tokenizer.vocab_size == dm.tokenizer.vocab_size
    assert dm3.val_split is not None and (dm.shards_path() / "val" / "index.json").is_file()
    assert not list((data_dir / "shards").glob("*.tmp-*")), "temp build dirs must not be left behind"


def _write_text_corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 200)
    with (root / "b.jsonl").open("w") as f:
        for i in range(100):
            f.write(json.dumps({"text": f"Document {i}: lorem ipsum dolor sit amet {i * i}.", "id": i}) + "\n")
        f.write("\n")
    (root / "ignored.md").write_text("# not a corpus file")
    return root


def test_text_corpus_and_rebuild_on_change(tmp_path: Path) -> None:
    root = _write_text_corpus(tmp_path / "corpus")
    corpus = text_corpus(root)
    assert [p.name for p in corpus.files] == ["a.txt", "b.jsonl"]
    docs = list(corpus.iter_texts())
    assert len(docs) == 1 + 100 and docs[1].startswith("Document 0:")

    kw = dict(
        corpus="text",
        path=str(root),
        seq_len=16,
        global_batch_size=2,
        data_dir=str(tmp_path / "cache"),
        tokenizer={"kind": "bpe", "vocab_size": 300},
        max_bytes=None,
        val_fraction=0.0,
    )
    dm = PretrainDataModule(**kw)
    dm.prepare_data()
    assert dm.last_prepare_built
    (b,) = batches(dm, 1)
    assert b.shape == (2, 17)
    text = dm.tokenizer.decode(torch.cat(batches(PretrainDataModule(**kw, shuffle=False))).flatten().tolist())
    assert "Document 7: lorem ipsum" in text and EOS_TOKEN in text

    old = dm.shards_path()
    dm = PretrainDataModule(**kw)
    dm.prepare_data()
    assert not dm.last_prepare_built
    with (root / "b.jsonl").open("a") as f:
        f.write(json.dumps({"text": "a brand new document"}) + "\n")
    dm = PretrainDataModule(**kw)
    dm.prepare_data()
    assert dm.last_prepare_built and dm.shards_path() != old


def test_documents_are_read_with_the_text_key_and_encoding_given(tmp_path: Path) -> None:
    """data.text_key and data.encoding reach every reader (the check, the tokenizer, the shard workers), and
    a corpus read another way is another cache entry; the default reading keeps the fingerprints it had."""
    root = tmp_path / "docs"
    root.mkdir()
    with (root / "a.jsonl").open("w") as f:
        for i in range(60):
            f.write(json.dumps({"id": i, "content": f"Document {i}: crème brûlée {i * i}."}) + "\n")
    (root / "b.txt").write_bytes("Un café, s'il vous plaît.\n".encode("latin-1") * 40)
    default = Corpus("text", root.resolve(), tuple(sorted(root.resolve().iterdir())))
    corpus = text_corpus(root, text_key="content", encoding="latin-1")
    assert default.fingerprint != corpus.fingerprint != replace(corpus, encoding="cp1252").fingerprint
    assert replace(corpus, text_key="text", encoding="utf-8").fingerprint == default.fingerprint
    assert "Un café, s'il vous plaît." in list(corpus.iter_texts())[-1]

    dm = PretrainDataModule(
        corpus="text",
        path=str(root),
        text_key="content",
        encoding="latin-1",
        seq_len=16,
        global_batch_size=2,
        data_dir=str(tmp_path / "cache"),
        tokenizer={"kind": "bpe", "vocab_size": 300},
        max_bytes=None,
        val_fraction=0.0,
        shuffle=False,
    )
    dm.prepare_data()
    text = dm.tokenizer.decode(torch.cat(batches(dm)).flatten().tolist())
    assert "Document 7: crème brûlée 49." in text and "Un café" in text


def test_bpe_tokenizer_cache(tmp_path: Path) -> None:
    files = [_write_text_corpus(tmp_path / "c") / "a.txt"]
    tok = train_bpe_tokenizer(files, 300, tmp_path / "tok")
    mtime = tok.path.stat().st_mtime_ns
    again = train_bpe_tokenizer(files, 300, tmp_path / "tok")
    assert again.path == tok.path and again.path.stat().st_mtime_ns == mtime
    assert train_bpe_tokenizer(files, 320, tmp_path / "tok").path != tok.path  # vocab is part of the key
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        train_bpe_tokenizer(files, 512, tmp_path / "tok", allow_train=False)  # non-zero ranks never train
    files[0].write_text("changed content\n" * 50)
    assert train_bpe_tokenizer(files, 300, tmp_path / "tok").path != tok.path  # inputs are part of the key
    # round trip + protocol + special ids
    assert isinstance(tok, Tokenizer)
    s = "The quick brown fox ünïcode\n"
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode([tok.eos_id]) == EOS_TOKEN and tok.bos_id is not None
    # a saved tokenizer.json loads through the "hf" path, as a Llama 3.1 one would
    hf = build_tokenizer("hf", str(tok.path), 0, None, tmp_path)
    assert isinstance(hf, HFTokenizer) and hf.encode(s) == tok.encode(s)


def test_hf_tokenizer_datamodule(data_dir: Path, tmp_path: Path) -> None:
    bpe = make_dm(data_dir).tokenizer
    dm = make_dm(tmp_path, tokenizer={"kind": "hf", "path": str(bpe.path)})  # type: ignore[attr-defined]
    assert dm.vocab_size == bpe.vocab_size
    dm_obj = make_dm(tmp_path, tokenizer=bpe)  # a ready Tokenizer object is accepted too
    assert dm_obj.tokenizer is bpe


# ---- bad input ------------------------------------------------------------------------
def test_bad_inputs(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.path=DIR") as e:
        PretrainDataModule(corpus="text", path=str(tmp_path / "nope"), data_dir=str(tmp_path))
    assert str(tmp_path / "nope") in str(e.value)
    with pytest.raises(ValueError, match=r"data\.path=DIR"):
        PretrainDataModule(corpus="text", path=None, data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer\.path=.*tokenizer\.json") as e:
        make_dm(tmp_path, tokenizer={"kind": "hf", "path": str(tmp_path / "missing.json")})
    assert "missing.json" in str(e.value)
    with pytest.raises(ValueError, match="hf, bpe"):
        make_dm(tmp_path, tokenizer={"kind": "sentencepiece"})
    with pytest.raises(ValueError, match=r"data\.seq_len"):
        make_dm(tmp_path, seq_len=0)
    with pytest.raises(ValueError, match=r"4096.*1000.*data\.tokenizer\.vocab_size"):
        make_dm(tmp_path, tokenizer={"kind": "bpe", "vocab_size": 4096}, model_vocab_size=1000)
    bpe_path = make_dm(data_dir).tokenizer.path  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"model vocab size 100"):
        make_dm(tmp_path, tokenizer={"kind": "hf", "path": str(bpe_path)}, model_vocab_size=100)
    with pytest.raises(ValueError, match="data.corpus"):
        load_corpus("wiki")
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match=r"data\.val_fraction"):
            make_dm(tmp_path, val_fraction=bad)

    empty = tmp_path / "empty"
    empty.mkdir()
    dm = PretrainDataModule(
        corpus="text", path=str(empty), data_dir=str(tmp_path / "c"), seq_len=8, global_batch_size=1
    )
    with pytest.raises(ValueError, match=r"No documents.*data\.path=DIR"):
        dm.prepare_data()
    (empty / "a.txt").write_text("")
    (empty / "b.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match=r"empty.*data\.path=DIR"):
        text_corpus(empty)
    assert not (tmp_path / "c" / "shards").exists()  # failed before any expensive work


def test_atomic_build_leaves_no_partial_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _write_text_corpus(tmp_path / "corpus")
    kw = dict(
        corpus="text",
        path=str(root),
        seq_len=16,
        global_batch_size=2,
        data_dir=str(tmp_path / "cache"),
        tokenizer={"kind": "bpe", "vocab_size": 300},
        max_bytes=None,
    )

    import litdata

    def crash(**kwargs: Any) -> None:
        Path(kwargs["output_dir"]).mkdir(parents=True)
        (Path(kwargs["output_dir"]) / "chunk-0-0.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(litdata, "optimize", crash)
    with pytest.raises(KeyboardInterrupt):
        PretrainDataModule(**kw).prepare_data()
    assert not [p for p in (tmp_path / "cache" / "shards").iterdir()]
    monkeypatch.undo()
    dm = PretrainDataModule(**kw)
    dm.prepare_data()
    assert dm.last_prepare_built and len(batches(dm, 1)) == 1


def test_resume_uses_dp_coords_not_global_world(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Global world 4 / dp 2, 2 workers: the rank's rows follow its dp coordinates, not the world."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("GLOBAL_RANK", "3")

    def dm_on_rank3(state: dict | None = None) -> PretrainDataModule:
        dm = make_dm(data_dir, global_batch_size=4, micro_batch_size=2, num_workers=2)
        dm.trainer = _trainer(3, 4, tp=2)
        if state:
            dm.load_state_dict(state)
        dm.setup("fit")
        return dm

    reference = batches(dm_on_rank3(), 4)
    state = dm_on_rank3().data_state(3)
    assert torch.equal(next(iter(dm_on_rank3(state).train_dataloader())), reference[3])
    single = batches(make_dm(data_dir, global_batch_size=4), 4)
    assert torch.equal(reference[3], single[3][2:])  # dp rank 1 of 2: the second half of step 3


# ---- validation split -----------------------------------------------------------------
def val_batches(dm: PretrainDataModule) -> list[torch.Tensor]:
    dm.setup("fit")
    loader = dm.val_dataloader()
    return [b for b in loader]


def _many_files(root: Path, n: int = 40) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(f"document {i} " * 20)
    return root


def test_val_split_by_file_disjoint_deterministic(data_dir: Path, tmp_path: Path) -> None:
    corpus = text_corpus(_many_files(tmp_path / "c1"))
    train, val = split_corpus(corpus, 0.25)
    assert val is not None and train.files and val.files
    assert set(train.files).isdisjoint(val.files) and set(train.files) | set(val.files) == set(corpus.files)
    assert list(train.files) == sorted(train.files, key=corpus.files.index)  # order kept
    rel = lambda c: [f.relative_to(c.root).as_posix() for f in c.files]  # noqa: E731
    assert all(val_hash(r) < 0.25 for r in rel(val)) and all(val_hash(r) >= 0.25 for r in rel(train))
    assert split_corpus(corpus, 0.25) == (train, val)  # deterministic
    # the split depends on the path relative to the corpus root only, not where the corpus lives
    moved = text_corpus(_many_files(tmp_path / "elsewhere" / "c2"))
    assert rel(split_corpus(moved, 0.25)[1]) == rel(val)  # type: ignore[arg-type]
    # fallbacks: nothing picked -> the last file; at least one training file; one file -> no val
    two = text_corpus(_write_text_corpus(tmp_path / "two"))
    t2, v2 = split_corpus(two, 1e-9)
    assert [p.name for p in t2.files] == ["a.txt"] and [p.name for p in v2.files] == ["b.jsonl"]  # type: ignore[union-attr]
    t_all, v_all = split_corpus(corpus, 0.999999)
    assert len(t_all.files) == 1 and len(v_all.files) == len(corpus.files) - 1  # type: ignore[union-attr]
    assert split_corpus(text_corpus(tmp_path / "two" / "a.txt"), 0.5)[1] is None
    # the datamodule trains on the train files only, and caches each split under its own key
    dm = make_dm(data_dir)
    dm.prepare_data()
    assert dm.val_corpus is not None and set(dm.train_corpus.files).isdisjoint(dm.val_corpus.files)
    assert set(dm.train_corpus.files) | set(dm.val_corpus.files) == set(dm.corpus.files)
    assert (dm.shards_path() / "val" / "index.json").is_file()
    assert make_dm(data_dir, val_fraction=0.5).shards_path() != dm.shards_path()


def test_val_batches_deterministic_and_seed_independent(data_dir: Path) -> None:
    a = val_batches(make_dm(data_dir, seed=1))
    b = val_batches(make_dm(data_dir, seed=2, shuffle=True))
    assert len(a) >= 2 and all(x.shape == (4, SEQ + 1) and x.dtype == torch.long for x in a)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    dm = make_dm(data_dir, seed=1)
    dm.setup("fit")
    loader = dm.val_dataloader()
    first = [x for x in loader]
    again = [x for x, _ in zip(loader, range(2))]  # a new evaluation restarts from the first batch
    assert all(torch.equal(x, y) for x, y in zip(first, a)) and torch.equal(again[0], a[0])
    # held out: no val row occurs in training
    train_rows = {tuple(r.tolist()) for t in batches(make_dm(data_dir, shuffle=False)) for r in t}
    assert not train_rows & {tuple(r.tolist()) for x in a for r in x}


def test_val_dp_slicing_matches_single_rank(data_dir: Path) -> None:
    ref = val_batches(make_dm(data_dir, global_batch_size=4, micro_batch_size=4))
    per_rank = [
        val_batches(make_dm(data_dir, global_batch_size=4, micro_batch_size=2, dp_rank=r, dp_size=2, seed=r))
        for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1]) == len(ref) > 0
    for k, want in enumerate(ref):
        assert torch.equal(torch.cat([per_rank[0][k], per_rank[1][k]]), want)
    # per-rank mean losses, dp-averaged, equal the single-process loss
    loss = lambda b: b.float().mean(dim=1)  # noqa: E731  (a per-row "loss")
    assert torch.allclose((loss(per_rank[0][0]).mean() + loss(per_rank[1][0]).mean()) / 2, loss(ref[0]).mean())


def test_val_fraction_zero_disables_validation(data_dir: Path) -> None:
    dm = make_dm(data_dir, val_fraction=0)
    dm.setup("fit")
    assert dm.val_corpus is None and dm.train_corpus == dm.corpus and dm.val_split is None
    assert dm.val_dataloader() == [] and not (dm.shards_path() / "val").exists()
    assert dm.shards_path() != make_dm(data_dir).shards_path()  # train set differs -> other shards


class _TinyValLM(_TinyLM):
    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.val_seen: list[torch.Tensor] = []

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.val_seen.append(batch.clone())
        x, y = batch[:, :-1], batch[:, 1:]
        loss = nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())
        self.log("val/loss", loss)
        return loss


@pytest.mark.parametrize("val_fraction", [0.02, 0.0])
def test_lightning_runs_val_loop(data_dir: Path, tmp_path: Path, val_fraction: float) -> None:
    model = _TinyValLM(1024)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=make_dm(data_dir, val_fraction=val_fraction))
    assert len(model.seen) == 4
    if val_fraction == 0:
        assert model.val_seen == [] and "val/loss" not in trainer.callback_metrics
        return
    ref = val_batches(make_dm(data_dir))[:2]
    assert len(model.val_seen) == 4  # 2 validation runs (after steps 2 and 4) x limit_val_batches=2
    for got, want in zip(model.val_seen, ref + ref):
        assert torch.equal(got, want)
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
