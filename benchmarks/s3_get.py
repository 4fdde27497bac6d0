"""GET latency and throughput by object size through lit_titan.data.remote (docs/data.md, S3 section).

    python benchmarks/s3_get.py                       # starts moto's server on 127.0.0.1 (tests/support/s3server.py)
    python benchmarks/s3_get.py --endpoint URL --bucket B   # any S3-compatible store; AWS_* credentials

Per size: ``download`` (litdata's chunk path: obstore) and ``read_bytes`` (boto3), median of --repeat
fresh GETs. Where the fixed cost of a request dominates, a store is request-bound: bigger chunks help.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint")
    parser.add_argument("--bucket", default="lit-titan-bench")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    import boto3

    from lit_titan.data import remote

    proc = None
    if args.endpoint is None:
        from s3server import S3Server, start_moto

        proc, endpoint = start_moto(Path(tempfile.mkdtemp()) / "moto.log")
        server = S3Server(endpoint, args.bucket)
        opts: dict | None = server.storage_options()
        boto3.client("s3", **opts).create_bucket(Bucket=args.bucket)
    else:
        opts = {"endpoint_url": args.endpoint}
    try:
        client = boto3.client("s3", **opts)
        print("| object | download (obstore) ms | MiB/s | read_bytes (boto3) ms | MiB/s |")
        print("|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as tmp:
            for size in SIZES:
                key = f"bench/{size}.bin"
                client.put_object(Bucket=args.bucket, Key=key, Body=os.urandom(size))
                url = f"s3://{args.bucket}/{key}"
                remote.download(url, Path(tmp) / "warm", opts)  # clients built, connections open
                dl, rb = [], []
                for i in range(args.repeat):
                    start = time.perf_counter()
                    assert remote.download(url, Path(tmp) / f"{size}-{i}", opts) == size
                    dl.append(time.perf_counter() - start)
                    os.remove(Path(tmp) / f"{size}-{i}")
                    start = time.perf_counter()
                    assert len(remote.read_bytes(url, opts)) == size
                    rb.append(time.perf_counter() - start)
                d, r = statistics.median(dl), statistics.median(rb)
                mib = size / (1 << 20)
                label = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
                print(f"| {label} | {d * 1e3:.1f} | {mib / d:.0f} | {r * 1e3:.1f} | {mib / r:.0f} |", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
