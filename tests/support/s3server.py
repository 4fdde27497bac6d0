"""A real S3-compatible server on 127.0.0.1 for the session: moto's server mode, in its own process.

Fixture ``s3_server`` (imported by tests/conftest.py) starts ``python -m moto.server`` on a free
loopback port, creates one bucket, yields an ``S3Server`` and stops the process at session end.
Plain http on purpose: it is the case litdata's obstore path gets wrong (docs/data.md). The server
is a separate process so its request handling does not share the test process's GIL.

Use ``server.storage_options()`` (data.storage_options) or ``server.env()`` (AWS_* variables,
e.g. with ``monkeypatch.setenv`` or for a subprocess); keys are dummies, moto accepts any.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    access_key: str = "lit-titan-test"
    secret_key: str = "lit-titan-test-secret"
    region: str = "us-east-1"

    def storage_options(self) -> dict[str, str]:
        """boto3 client keywords, as ``data.storage_options`` carries them."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a process at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def url(self, prefix: str | None = None) -> str:
        """``s3://BUCKET/PREFIX`` with a fresh unique prefix when none is given (tests do not collide)."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def start_moto(log_path: Path, tries: int = 3, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start moto's server on a free port (another port if one is taken in the meantime).

    ``env``: extra server settings, e.g. ``INITIAL_NO_AUTH_ACTION_COUNT=0`` to check credentials.
    """
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **(env or {})}
    for _ in range(tries):
        port = _free_port()
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        if _wait_listening(proc, port, timeout_s=60):
            return proc, f"http://127.0.0.1:{port}"
        proc.kill()
        proc.wait()
    raise RuntimeError(f"moto server did not start; see {log_path}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    import boto3

    proc, endpoint = start_moto(tmp_path_factory.mktemp("s3server") / "moto.log")
    try:
        server = S3Server(endpoint, bucket="lit-titan")
        boto3.client("s3", **server.storage_options()).create_bucket(Bucket=server.bucket)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
