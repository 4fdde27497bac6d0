"""lit_titan.data.remote against a real S3-compatible server on 127.0.0.1 (tests/support/s3server.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import boto3
import pytest

from lit_titan.data import remote
from lit_titan.data.corpus import stdlib_corpus
from lit_titan.data.prepare import prepare_shards
from lit_titan.data.tokenizers import train_bpe_tokenizer
from lit_titan.errors import ConfigError


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote")
    corpus = stdlib_corpus(300_000)
    tokenizer = train_bpe_tokenizer(corpus, 512, root / "tok")
    prepare_shards(corpus, None, tokenizer, root / "prepared", chunk_tokens=4096)
    return root / "prepared"


@pytest.fixture(scope="module")
def uploaded(prepared, s3_server) -> str:
    url = s3_server.url()
    remote.upload_dir(prepared, url, s3_server.storage_options())
    return url


def _local_files(directory: Path) -> dict[str, Path]:
    return {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}


def test_upload_read_download_round_trip(prepared, uploaded, s3_server, tmp_path):
    opts = s3_server.storage_options()
    bucket, prefix = uploaded[len("s3://") :].split("/", 1)
    listed = boto3.client("s3", **opts).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    assert sorted(o["Key"][len(prefix) + 1 :] for o in listed) == sorted(_local_files(prepared))

    assert remote.read_bytes(f"{uploaded}/manifest.json", opts) == (prepared / "manifest.json").read_bytes()
    index = json.loads(remote.read_bytes(f"{uploaded}/train/index.json", opts))
    assert index == json.loads((prepared / "train" / "index.json").read_text())
    chunks = [c["filename"] for c in index["chunks"]]
    assert len(chunks) >= 5
    total = 0
    for name in chunks:
        got = remote.download(f"{uploaded}/train/{name}", tmp_path / "train" / name, opts)
        local = (prepared / "train" / name).read_bytes()
        assert got == len(local) and (tmp_path / "train" / name).read_bytes() == local
        total += got
    assert total == sum((prepared / "train" / n).stat().st_size for n in chunks)
    # Present already: nothing downloaded; no temp files left beside the chunks.
    assert remote.download(f"{uploaded}/train/{chunks[0]}", tmp_path / "train" / chunks[0], opts) == 0
    assert not [p for p in (tmp_path / "train").iterdir() if ".part-" in p.name]
    remote.preflight(uploaded, opts)


def test_litdata_obstore_refuses_plain_http(uploaded, s3_server, tmp_path):
    """The trap remote.py works around: if this starts passing, litdata fixed it (docs/data.md)."""
    from litdata.streaming import downloader as litdata_downloader

    obstore_usable = getattr(litdata_downloader, "obstore_usable", None)
    if obstore_usable is None:
        pytest.skip("this litdata downloads chunks with boto3, not obstore (0.2.60 does): no trap")
    S3Downloader = litdata_downloader.S3Downloader
    assert obstore_usable(), "obstore unusable in this process: the chunk path under test would be boto3"
    downloader = S3Downloader(uploaded, str(tmp_path), [], storage_options=s3_server.storage_options())
    with pytest.raises(Exception, match="builder error"):
        downloader.download_file(f"{uploaded}/manifest.json", str(tmp_path / "manifest.json"))


def _download_at_barrier(barrier, url: str, dest: str, opts: dict, results) -> None:
    barrier.wait()
    try:
        results.put(remote.download(url, Path(dest), opts))
    except Exception as e:  # the parent fails with it, instead of waiting for a result
        results.put(repr(e))


@pytest.mark.slow
def test_two_processes_download_a_chunk_once(s3_server, tmp_path):
    opts = s3_server.storage_options()
    url = f"{s3_server.url()}/big.bin"
    payload = os.urandom(8 << 20)  # large enough that both processes are inside download() together
    bucket, key = url[len("s3://") :].split("/", 1)
    boto3.client("s3", **opts).put_object(Bucket=bucket, Key=key, Body=payload)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    dest = tmp_path / "cache" / "big.bin"
    procs = [ctx.Process(target=_download_at_barrier, args=(barrier, url, str(dest), opts, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]  # spawn + import lit_titan: minutes under heavy load
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(got, key=str) == [0, len(payload)], got
    assert dest.read_bytes() == payload


def test_endpoint_from_environment(uploaded, prepared, s3_server, tmp_path, monkeypatch):
    from s3server import _free_port

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    # First a dead endpoint, then the live one: a client cached from the first must not be reused.
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead := f"http://127.0.0.1:{_free_port()}")
    assert dead in _refused(remote.read_bytes, f"{uploaded}/manifest.json")[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    assert remote.read_bytes(f"{uploaded}/manifest.json") == (prepared / "manifest.json").read_bytes()
    name = json.loads((prepared / "train" / "index.json").read_text())["chunks"][0]["filename"]
    assert remote.download(f"{uploaded}/train/{name}", tmp_path / name) == (prepared / "train" / name).stat().st_size
    remote.preflight(uploaded)


def _refused(fn, *args, **kwargs) -> tuple[str, float]:
    """``fn(*args)`` raises a one-line ConfigError: its message and how long it took."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message, time.monotonic() - start


def test_bad_inputs_one_line_fast(uploaded, prepared, s3_server, tmp_path, monkeypatch):
    from s3server import _free_port

    opts = s3_server.storage_options()
    dead = f"http://127.0.0.1:{_free_port()}"
    message, took = _refused(remote.preflight, uploaded, {**opts, "endpoint_url": dead})
    assert "cannot reach the S3 endpoint" in message and dead in message and "AWS_ENDPOINT_URL" in message
    assert "data.storage_options.endpoint_url" in message and took < 10
    message, took = _refused(
        remote.download, f"{uploaded}/train/chunk-0-0.bin", tmp_path / "c", {**opts, "endpoint_url": dead}
    )
    assert "cannot reach" in message and took < 20

    message, _ = _refused(remote.preflight, "s3://no-such-bucket/p", opts)
    assert "bucket 'no-such-bucket' does not exist" in message
    message, _ = _refused(remote.preflight, f"s3://{s3_server.bucket}/no/such/prefix", opts)
    assert message == (
        "no manifest.json under s3://lit-titan/no/such/prefix: run `lit-titan prepare ... "
        "out=s3://lit-titan/no/such/prefix` first"
    )
    message, _ = _refused(remote.download, f"{uploaded}/train/chunk-9-9.bin", tmp_path / "c", opts)
    assert "does not exist" in message and not (tmp_path / "c").exists()
    typo = {"endpoint": s3_server.endpoint_url, "aws_secret_access_key": "s3cr3t"}
    for fn in (remote.read_bytes, remote.preflight):
        message, _ = _refused(fn, f"{uploaded}/manifest.json", typo)
        assert "data.storage_options" in message and "not a valid S3 client setting" in message
        assert "'endpoint'" in message and "s3cr3t" not in message
    message, _ = _refused(remote.download, f"{uploaded}/manifest.json", tmp_path / "m", typo)
    assert "not a valid S3 client setting" in message
    message, _ = _refused(remote.upload_dir, prepared, "s3://no-such-bucket/p", opts)
    assert "bucket 'no-such-bucket' does not exist" in message

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no 1 s instance-metadata probe
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    message, _ = _refused(remote.read_bytes, f"{uploaded}/manifest.json", {"endpoint_url": s3_server.endpoint_url})
    assert "no usable S3 credentials" in message and "AWS_ACCESS_KEY_ID" in message

    with pytest.raises(ConfigError, match="only local paths and s3://"):
        remote.is_remote("gs://bucket/prefix")
    assert remote.is_remote("s3://b/p") and not remote.is_remote("/data/prepared")


def test_refused_credentials(tmp_path):
    """A store that checks keys (moto with IAM auth on) refuses dummy ones: one line naming the keys."""
    from s3server import S3Server, start_moto

    proc, endpoint = start_moto(tmp_path / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        opts = S3Server(endpoint, "any").storage_options()
        message, took = _refused(remote.preflight, "s3://any/prefix", opts)
        assert "S3 refused the credentials" in message and "InvalidAccessKeyId" in message
        assert "AWS_ACCESS_KEY_ID" in message and took < 10
    finally:
        proc.terminate()
        proc.wait()
