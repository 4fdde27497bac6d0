"""Shards on an S3-compatible store: the loopback server (tests/support/s3server.py) and the real litdata path.

Prepare -> upload -> read: every rank's batches equal the local shards' batches, the ranks of a
node (data-parallel ranks and their TP peers, in lockstep) download about the dataset once per
epoch, and training from S3 gives the losses of training from the local copy.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_order import SEQ, _passes

from helpers import TINY, losses, synthetic_corpus
from lit_titan.data import PretrainDataModule, prepare_shards, split_corpus, text_corpus
from lit_titan.data.remote import upload_dir
from lit_titan.data.tokenizers import train_bpe_tokenizer


@pytest.fixture(scope="module")
def uploaded(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("s3data")
    corpus = text_corpus(synthetic_corpus(base / "docs", 120, 300, seed=5))
    tok = train_bpe_tokenizer(corpus, 512, base / "tok")
    train, val = split_corpus(corpus, 0.05)
    prepare_shards(train, val, tok, base / "local", chunk_tokens=256)
    url = s3_server.url()
    upload_dir(base / "local", url, s3_server.storage_options())
    return {"local": str(base / "local"), "url": url, "options": s3_server.storage_options(), "base": base}


def _dm(path: str, cache: Path, options: dict | None, **kw: Any) -> PretrainDataModule:
    dm = PretrainDataModule(
        corpus="tokens",
        path=path,
        tokenizer={"kind": "shards"},
        seq_len=SEQ,
        global_batch_size=16,
        data_dir=str(cache),
        storage_options=options,
        seed=3,
        **kw,
    )
    dm.setup("fit")
    return dm


def test_a_node_downloads_each_chunk_about_once_and_reads_match_local(uploaded: dict[str, Any], tmp_path: Path) -> None:
    """dp=4, each dp rank with a TP peer (8 readers in lockstep, one node cache): <= 1.05 x the dataset."""
    dp, peers = 4, 2
    cache = tmp_path / "node-cache"
    readers = [(rank, peer) for rank in range(dp) for peer in range(peers)]
    modules = {key: _dm(uploaded["url"], cache, uploaded["options"], dp_rank=key[0], dp_size=dp) for key in readers}
    loaders = {key: dm.train_dataloader() for key, dm in modules.items()}
    steps = modules[(0, 0)].train_batches.steps_per_epoch
    barrier = threading.Barrier(len(readers))
    seen: dict[tuple[int, int], list[torch.Tensor]] = {key: [] for key in readers}
    errors: list[BaseException] = []

    def read(key: tuple[int, int]) -> None:
        try:
            for _, batch in zip(range(steps), _passes(loaders[key])):
                seen[key].append(batch)
                barrier.wait(timeout=120)  # lockstep, as the collectives of a training step keep peers
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=read, args=(key,)) for key in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    total = sum((Path(uploaded["local"]) / "train" / f).stat().st_size for f in modules[(0, 0)].train_splits[0].files)
    downloaded = sum(dm.train_batches.bytes_read for dm in modules.values())
    assert 0.9 * total < downloaded <= 1.05 * total, (downloaded, total)
    for rank in range(dp):
        local = _dm(uploaded["local"], tmp_path / "local-cache", None, dp_rank=rank, dp_size=dp)
        want = [b for _, b in zip(range(steps), _passes(local.train_dataloader()))]
        for peer in range(peers):
            assert len(seen[(rank, peer)]) == steps
            assert all(torch.equal(a, b) for a, b in zip(seen[(rank, peer)], want)), (rank, peer)


@pytest.mark.slow
def test_training_from_s3_equals_training_from_the_local_copy(
    uploaded: dict[str, Any], tmp_path: Path, worlds: Any
) -> None:
    options = ",".join(f"{k}:'{v}'" for k, v in uploaded["options"].items())
    common = [
        *TINY,
        "trainer.max_steps=6",
        "precision=32-true",
        "cluster.devices=2",
        "data=tokens",
        "model.vocab_size=512",
    ]
    worlds.train([*common, f"data.path={uploaded['local']}"], tmp_path / "local")
    worlds.train(
        [
            *common,
            f"data.path={uploaded['url']}",
            f"data.storage_options={{{options}}}",
            f"data.data_dir={tmp_path / 'cache'}",
        ],
        tmp_path / "s3",
    )
    assert len(losses(tmp_path / "local")) == 6
    assert losses(tmp_path / "s3") == losses(tmp_path / "local")  # the same bytes, the same losses


def test_bad_s3_settings_are_one_line(uploaded: dict[str, Any], tmp_path: Path) -> None:
    from lit_titan.errors import ConfigError

    with pytest.raises(ConfigError, match="manifest"):
        _dm(uploaded["url"] + "-missing", tmp_path, uploaded["options"])
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:9"):
        _dm(uploaded["url"], tmp_path, {**uploaded["options"], "endpoint_url": "http://127.0.0.1:9"})
