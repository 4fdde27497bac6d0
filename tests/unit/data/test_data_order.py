"""The global order: layout independence, coverage, shuffle quality, read volume, mixtures, resume cost.

Everything here runs the real loaders over real prepared shards in this process (no process
group is needed: a data-parallel rank is given by ``dp_rank``/``dp_size``); the training-level
parity runs are in tests/parity/test_data_parity.py.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import synthetic_corpus
from lit_titan.data import Blend, GlobalBatches, PretrainDataModule, SourceOrder, prepare_shards, text_corpus
from lit_titan.data.corpus import split_corpus
from lit_titan.data.tokenizers import train_bpe_tokenizer

SEQ = 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two prepared sources with one tokenizer: `a` (~240 small chunks) and `b` (smaller, other words)."""
    base = tmp_path_factory.mktemp("order")
    a_corpus = text_corpus(synthetic_corpus(base / "a_docs", 240, 300, seed=1))
    tok = train_bpe_tokenizer(a_corpus, 512, base / "tok")
    a_train, a_val = split_corpus(a_corpus, 0.05)
    prepare_shards(a_train, a_val, tok, base / "a", chunk_tokens=256)
    b_train, _ = split_corpus(text_corpus(synthetic_corpus(base / "b_docs", 40, 200, seed=2, tag="b")), 0.0)
    prepare_shards(b_train, None, tok, base / "b", chunk_tokens=256)
    return {"a": str(base / "a"), "b": str(base / "b"), "cache": str(base / "cache"), "tok": tok}


def _dm(shards: dict[str, Any], **kw: Any) -> PretrainDataModule:
    args: dict[str, Any] = dict(
        corpus="tokens",
        path=shards["a"],
        seq_len=SEQ,
        global_batch_size=8,
        data_dir=shards["cache"],
        tokenizer={"kind": "shards"},
        seed=7,
    )
    args.update(kw)
    dm = PretrainDataModule(**args)
    dm.setup("fit")
    return dm


def _passes(loader: Any) -> Any:
    """Iterate ``loader`` epoch after epoch, as Lightning does (``set_epoch`` before each pass)."""
    for epoch in range(1000):
        loader.sampler.set_epoch(epoch)
        yield from loader


def _rank_streams(shards: dict[str, Any], dp: int, micro: int, workers: int, steps: int, **kw: Any) -> list[list]:
    """Per optimizer step, the multiset of samples (token tuples) all dp ranks trained on."""
    per_step: list[Counter] = [Counter() for _ in range(steps)]
    for rank in range(dp):
        dm = _dm(shards, dp_rank=rank, dp_size=dp, micro_batch_size=micro, num_workers=workers, **kw)
        accumulation = dm.grad_accum_steps
        for i, batch in zip(range(steps * accumulation), _passes(dm.train_dataloader())):
            assert batch.shape == (micro, SEQ + 1) and batch.dtype == torch.long
            per_step[i // accumulation].update(tuple(row) for row in batch.tolist())
    return per_step


def test_same_samples_every_step_for_any_layout_and_workers(shards: dict[str, Any]) -> None:
    """(dp, micro, workers) in (1,8,0), (2,4,1), (4,2,2), (8,1,0): the same samples per step over 2 epochs."""
    dm = _dm(shards)
    dm.train_dataloader()
    epoch_steps = dm.train_batches.steps_per_epoch
    assert 20 < epoch_steps < 600
    steps = 2 * epoch_steps + 1  # into the third epoch
    ref = _rank_streams(shards, 1, 8, 0, steps)
    assert all(sum(c.values()) == 8 for c in ref)
    for dp, micro, workers in ((2, 4, 1), (4, 2, 2), (8, 1, 0)):
        got = _rank_streams(shards, dp, micro, workers, steps)
        bad = [k for k in range(steps) if got[k] != ref[k]]
        assert not bad, f"dp={dp} micro={micro} workers={workers}: steps {bad[:5]} differ"
    assert ref[0] != ref[epoch_steps]  # a new epoch, a new order


def _epoch_samples(batches: GlobalBatches, epoch: int) -> list[tuple[int, int]]:
    order = batches.orders[0]
    steps = order.per_epoch // batches.global_batch
    out = []
    for k in range(epoch * steps, (epoch + 1) * steps):
        rows = batches.rows(k)
        chunks, samples = order.locate(rows.position)
        out += list(zip(chunks.tolist(), samples.tolist()))
    return out


def test_every_sample_once_per_epoch_and_well_shuffled(shards: dict[str, Any]) -> None:
    dm = _dm(shards, global_batch_size=16)
    dm.train_dataloader()
    batches = dm.train_batches
    per_chunk = dm.train_splits[0].samples_per_chunk(SEQ)
    everything = {(c, s) for c in range(len(per_chunk)) for s in range(int(per_chunk[c]))}
    for epoch in (0, 1):
        seen = _epoch_samples(batches, epoch)
        assert len(seen) == len(set(seen)), "a sample repeated within an epoch"
        assert set(seen) <= everything and len(everything) - len(seen) < 16  # < one global batch left out
    # shuffle quality: sample ids (chunk-major) uncorrelated with their position in the epoch
    seen = _epoch_samples(batches, 0)
    ids = np.array([c * 10_000 + s for c, s in seen])
    rank_ids = np.argsort(np.argsort(ids))
    rho = np.corrcoef(rank_ids, np.arange(len(ids)))[0, 1]
    assert abs(rho) < 0.1, rho
    # ... and every global batch mixes many chunks (16 streams spread over the permuted epoch)
    distinct = [len({c for c, _ in seen[k * 16 : (k + 1) * 16]}) for k in range(len(seen) // 16)]
    assert min(distinct) >= 12 and np.mean(distinct) >= 14, (min(distinct), np.mean(distinct))


@pytest.mark.parametrize("window", [2048, 16])
def test_each_rank_reads_only_its_share(shards: dict[str, Any], window: int) -> None:
    """One epoch at dp=4: the chunk bytes all ranks open together are <= 1.05 x the dataset (was ~4x).

    With a window shorter than a stream, chunks are released as the order moves past them, and
    still none is opened twice.
    """
    dp = 4
    total = sum((Path(shards["a"]) / "train" / f).stat().st_size for f in _dm(shards).train_splits[0].files)
    opened = 0
    for rank in range(dp):
        dm = _dm(shards, dp_rank=rank, dp_size=dp, global_batch_size=16, shuffle_window=window)
        loader = dm.train_dataloader()
        steps = dm.train_batches.steps_per_epoch
        for _ in zip(range(steps * dm.grad_accum_steps), _passes(loader)):
            pass
        opened += dm.train_batches.bytes_read
        if window < dm.train_batches.orders[0].stream_len:
            assert len(dm.train_splits[0].open_chunks) < 16, "chunks not released after their last use"
    assert total * 0.9 < opened <= 1.05 * total, (opened, total)


def test_mixture_shares_per_batch_and_resume(shards: dict[str, Any]) -> None:
    weights = [3.0, 1.0, 1.0]
    blend = Blend(weights, 16)
    target = np.array(weights) / sum(weights) * 16
    counts = np.array([blend.counts(k) for k in range(300)])
    assert (counts.sum(axis=1) == 16).all()
    assert (np.abs(counts - target) <= 1).all()  # every batch within one sample of weight x batch
    assert np.abs(counts.sum(axis=0) - target * 300).max() <= 1  # and on target over the run
    # a blend resumed from the stored counters continues the same sequence
    resumed = Blend(weights, 16, step=123, consumed=Blend(weights, 16).consumed_at(123))
    assert all((resumed.counts(k) == counts[k]).all() for k in range(123, 300))
    # through the datamodule: two real sources, 3:1, tokens-per-source counters
    dm = _dm(
        shards,
        corpus="mixture",
        path=None,
        global_batch_size=16,
        sources=[{"path": shards["a"], "weight": 3}, {"path": shards["b"], "weight": 1}],
    )
    dm.train_dataloader()
    for k in range(50):
        rows = dm.train_batches.rows(k)
        assert Counter(rows.source.tolist()) == {0: 12, 1: 4}
    state = dm.data_state(50)
    assert state["consumed"] == [600, 200] and len(json.dumps(state)) < 1024
    # source b is small: it is repeated (epochs counted per source), a never runs dry
    b_epoch = dm.train_batches.orders[1].per_epoch
    assert 200 * 4 > b_epoch
    rows = [dm.train_batches.rows(k) for k in range(0, 2 * b_epoch // 4 + 2)]
    assert max(int(r.position[r.source == 1].max()) for r in rows) >= 2 * b_epoch


def test_resume_planning_is_fast_at_fleet_scale() -> None:
    """10^8 samples in 2*10^5 chunks, global batch 1024: placing step 90,000 takes well under 1 s.

    CPU time of this process, the least of 3 tries: a loaded machine lengthens wall time, not this."""

    def place() -> tuple[float, SourceOrder, np.ndarray, np.ndarray]:
        start = time.process_time()
        order = SourceOrder(np.full(200_000, 500), seed=0, streams=1024, window=2048)
        blend = Blend([1.0], 1024, step=90_000, consumed=[90_000 * 1024])
        positions = np.arange(blend.consumed_at(90_000)[0], blend.consumed_at(90_001)[0])
        chunks, samples = order.locate(positions)
        return time.process_time() - start, order, chunks, samples

    tries = [place() for _ in range(3)]
    cpu, order, chunks, samples = min(tries, key=lambda t: t[0])
    assert len(set(chunks.tolist())) > 1000 and cpu < 1.0, [t[0] for t in tries]
    assert order.total == 10**8 and (samples < 500).all()


def test_bad_inputs_are_one_line_before_any_work(shards: dict[str, Any], tmp_path: Path) -> None:
    from lit_titan.errors import ConfigError

    empty = tmp_path / "not_prepared"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"data\.path=.*no manifest\.json.*lit-titan prepare"):
        _dm(shards, path=str(empty))
    with pytest.raises(ConfigError, match=r"data\.path=.*no such directory"):
        _dm(shards, path=str(tmp_path / "missing"))
    other = train_bpe_tokenizer([Path(shards["b"]).parent / "b_docs" / "bdoc0001.txt"], 300, tmp_path / "tok")
    with pytest.raises(ConfigError, match="prepared with another tokenizer"):
        _dm(shards, tokenizer={"kind": "hf", "path": str(other.path)})
    with pytest.raises(ConfigError, match="does not apply to prepared shards"):
        _dm(shards, tokenizer={"kind": "bpe", "vocab_size": 512})
    for weight in (0, -1, "x"):
        with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.weight=.*positive"):
            _dm(
                shards,
                corpus="mixture",
                sources=[{"path": shards["a"], "weight": 1}, {"path": shards["b"], "weight": weight}],
            )
    with pytest.raises(ConfigError, match=r"data=mixture needs data\.sources"):
        _dm(shards, corpus="mixture", path=None)
    # a source prepared with another vocabulary
    c = text_corpus(synthetic_corpus(tmp_path / "c_docs", 5, 50, seed=3))
    prepare_shards(c, None, other, tmp_path / "c", chunk_tokens=256)
    with pytest.raises(ConfigError, match="different tokenizers"):
        _dm(
            shards,
            corpus="mixture",
            sources=[{"path": shards["a"], "weight": 1}, {"path": str(tmp_path / "c"), "weight": 1}],
        )
    # an empty source (its documents shorter than one sample)
    tiny = tmp_path / "tiny_docs"
    tiny.mkdir()
    (tiny / "a.txt").write_text("w1 w2\n")
    prepare_shards(text_corpus(tiny), None, shards["tok"], tmp_path / "tiny", chunk_tokens=256)
    with pytest.raises(ConfigError, match=r"data\.sources\[1\].*holds no sample"):
        _dm(
            shards,
            corpus="mixture",
            sources=[{"path": shards["a"], "weight": 1}, {"path": str(tmp_path / "tiny"), "weight": 1}],
        )
    with pytest.raises(ConfigError, match=r"data\.shuffle_window"):
        _dm(shards, shuffle_window=0)


def test_document_positions_restart_after_eos(shards: dict[str, Any]) -> None:
    from lit_titan.models.llama3 import Transformer, get_flavor
    from lit_titan.module import PretrainModule

    # documents (stdlib files) shorter than a chunk: samples straddle document boundaries
    docs = dict(
        corpus="stdlib", path=None, max_bytes=200_000, tokenizer={"kind": "bpe", "vocab_size": 512}, global_batch_size=4
    )
    dm = _dm(shards, document_positions=True, **docs)
    eos = dm.train_splits[0].eos_id
    plain_batches = iter(_dm(shards, **docs).train_dataloader())
    for batch, plain_batch in zip(dm.train_dataloader(), plain_batches):  # the first batch with a boundary
        assert torch.equal(batch["tokens"], plain_batch)
        if (batch["tokens"][:, 1:-1] == eos).any():
            break
    tokens, positions = batch["tokens"], batch["positions"]
    assert positions.shape == (4, SEQ)
    for row, pos in zip(tokens[:, :-1], positions):
        for i in range(1, SEQ):
            assert pos[i] == (0 if row[i - 1] == eos else pos[i - 1] + 1)
    assert (tokens[:, :-1] == eos).any(), "the test data should hold a document boundary"
    module = PretrainModule(model="llama3_debug")
    module.model = Transformer(get_flavor("llama3_debug", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=512))
    got_tokens, extra = module.unpack_batch(batch)  # what training_step / validation_step unpack
    assert got_tokens is tokens and extra == {"positions": positions}
    inputs, labels = module.split_batch(tokens)
    loss = module.compute_loss(module(inputs, positions), labels)
    plain = module.compute_loss(module(inputs), labels)
    assert torch.isfinite(loss) and not torch.equal(loss, plain)  # the positions reach the rotary embedding


@pytest.mark.parametrize("cross", [False, True])
def test_document_masking_marks_each_eos_label_unless_crossing_labels_are_trained(
    shards: dict[str, Any], cross: bool
) -> None:
    docs = dict(
        corpus="stdlib", path=None, max_bytes=200_000, tokenizer={"kind": "bpe", "vocab_size": 512}, global_batch_size=4
    )
    dm = _dm(shards, document_masking=True, cross_document_labels=cross, **docs)
    eos = dm.train_splits[0].eos_id
    for batch in dm.train_dataloader():  # the first batch with a boundary
        if (batch["tokens"][:, :-1] == eos).any():
            break
    assert ("ignore" in batch) is not cross
    if not cross:
        assert torch.equal(batch["ignore"], batch["tokens"][:, :-1] == eos)
