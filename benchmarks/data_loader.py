"""Data loader throughput: tokens/s per rank from prepared shards, local and from a loopback S3 server.

Prepares a corpus once (the embedded standard-library corpus by default), then for each source
(local directory, and the same directory uploaded to an S3-compatible server started here on
127.0.0.1: moto's server mode) and each number of loader workers, iterates one data-parallel
rank's loader (rank 0 of ``--dp``) and reports tokens/s delivered to the training loop, plus the
bytes that rank read or downloaded. Nothing trains; the figure is the loader's ceiling.

    python benchmarks/data_loader.py                          # the table in docs/benchmarks.md
    python benchmarks/data_loader.py --smoke                  # seconds: what the CPU test runs
    python benchmarks/data_loader.py --s3-endpoint http://host:9000 --s3-url s3://bucket/prefix  # your store

The goal is >= 1M tokens/s per rank from local shards on 2 CPU cores: two orders of magnitude above
what an 8B model consumes on one H100 (docs/benchmarks.md), so loading never gates a step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _start_loopback_s3(workdir: Path) -> tuple[Any, dict[str, str]]:
    """moto's S3 server on a free 127.0.0.1 port (tests/support/s3server.py), with one bucket."""
    import boto3

    spec = importlib.util.spec_from_file_location("s3server", REPO / "tests" / "s3server.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["s3server"] = module  # its dataclass looks its module up while being defined
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    proc, endpoint = module.start_moto(workdir / "moto.log")
    server = module.S3Server(endpoint, bucket="bench")
    boto3.client("s3", **server.storage_options()).create_bucket(Bucket=server.bucket)
    return proc, {"endpoint": endpoint, "url": server.url("shards"), **server.storage_options()}


def _prepare(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from lit_titan.data import prepare_shards, split_corpus, stdlib_corpus
    from lit_titan.data.tokenizers import train_bpe_tokenizer

    corpus = stdlib_corpus(args.max_bytes)
    train, _ = split_corpus(corpus, 0.0)
    tokenizer = train_bpe_tokenizer(train, args.vocab, out.parent / "tokenizers")
    return prepare_shards(train, None, tokenizer, out, chunk_tokens=args.chunk_tokens, num_workers=2)


def _measure(
    path: str, args: argparse.Namespace, workers: int, cache: Path, storage_options: dict | None
) -> dict[str, float]:
    from lit_titan.data import PretrainDataModule

    dm = PretrainDataModule(
        corpus="tokens",
        path=path,
        tokenizer={"kind": "shards"},
        seq_len=args.seq_len,
        global_batch_size=args.dp * args.micro,
        micro_batch_size=args.micro,
        dp_rank=0,
        dp_size=args.dp,
        num_workers=workers,
        data_dir=str(cache),
        storage_options=storage_options,
        pin_memory=False,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    steps = args.steps

    def passes():  # epoch after epoch, as Lightning iterates (a new chunk order each epoch)
        for epoch in range(10**6):
            loader.sampler.set_epoch(epoch)
            yield from loader

    it = passes()
    next(it)  # worker start-up and the first chunk are not throughput
    tokens, start = 0, time.perf_counter()
    for _, batch in zip(range(steps - 1), it):
        tokens += batch.shape[0] * (batch.shape[1] - 1)
    seconds = time.perf_counter() - start
    del it
    # bytes are counted in the process that reads them: with workers, in the workers (not reported)
    read = dm.train_batches.bytes_read / 2**20 if workers == 0 else float("nan")
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "mib_read": read}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny corpus and few steps (CI)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--dp", type=int, default=4, help="data-parallel size; rank 0 is measured")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=1 << 18)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--s3-endpoint", help="an existing S3-compatible endpoint instead of the loopback server")
    parser.add_argument("--s3-url", help="s3://BUCKET/PREFIX to upload to (with --s3-endpoint)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seq_len, args.micro, args.steps, args.max_bytes, args.vocab = 256, 4, 20, 300_000, 512
        args.chunk_tokens, args.workers = 1 << 14, [0, 1]

    work = Path(tempfile.mkdtemp(prefix="lit-titan-data-bench-"))
    local = work / "shards"
    manifest = _prepare(args, local)
    sources: list[tuple[str, str, dict | None]] = [("local", str(local), None)]
    proc = None
    if not args.no_s3:
        from lit_titan.data.remote import upload_dir

        if args.s3_endpoint:
            options = {"endpoint_url": args.s3_endpoint}
            url = args.s3_url or f"s3://lit-titan-bench/{uuid.uuid4().hex[:8]}"
        else:
            proc, server = _start_loopback_s3(work)
            options = {
                k: server[k] for k in ("endpoint_url", "aws_access_key_id", "aws_secret_access_key", "region_name")
            }
            url = server["url"]
        upload_dir(local, url, options)
        sources.append(("s3 (loopback)" if proc else "s3", url, options))
    rows = []
    try:
        for name, path, options in sources:
            for workers in args.workers:
                cache = work / f"cache-{name.split()[0]}-{workers}"  # cold cache: every S3 chunk is downloaded
                result = _measure(path, args, workers, cache, options)
                rows.append({"source": name, "workers": workers, **result})
                print(
                    f"{name:14s} workers={workers}  {result['tokens_per_s'] / 1e6:8.2f} M tokens/s per rank  "
                    f"({result['tokens']} tokens in {result['seconds']:.2f} s, {result['mib_read']:.1f} MiB read)",
                    flush=True,
                )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    info = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "seq_len": args.seq_len,
        "micro": args.micro,
        "dp": args.dp,
        "dataset_tokens": manifest["splits"]["train"]["tokens"],
        "chunks": manifest["splits"]["train"]["chunks"],
        "chunk_tokens": args.chunk_tokens,
        "steps": args.steps,
    }
    print(json.dumps(info))
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
