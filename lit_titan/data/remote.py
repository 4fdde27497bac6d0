"""Object storage for prepared shard directories: the only module that talks to S3.

Everything goes through litdata's own S3 support (``S3Client`` builds the boto3 client,
``S3Downloader`` fetches chunks, through obstore where litdata uses it), configured the standard
AWS way: ``AWS_ENDPOINT_URL`` and credentials from the environment, or ``storage_options``
(``data.storage_options``: any ``boto3.client("s3", ...)`` keyword, e.g. ``endpoint_url``,
``aws_access_key_id``, ``region_name``). Any S3-compatible store works, plain-http ones included.

Every failure a user can fix becomes one ``ConfigError`` line naming the setting, within a bounded
time: litdata's boto3 default (1,000 adaptive retries) would retry an unreachable endpoint for
minutes, so every client here carries its own timeouts and a few retries.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lit_titan.errors import ConfigError

MANIFEST = "manifest.json"  # == lit_titan.data.prepare.MANIFEST (not imported: prepare pulls in torch)
_ENDPOINT_KEYS = "AWS_ENDPOINT_URL (or data.storage_options.endpoint_url)"
_CREDENTIAL_KEYS = (
    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or data.storage_options.aws_access_key_id/aws_secret_access_key)"
)
# Chunk downloads and uploads: patient with a slow store, yet bounded against a dead one.
_TRANSFER_TIMEOUT_S = 60.0
_TRANSFER_ATTEMPTS = 5
# An endpoint that served this run and stops answering (an outage, not a setting): chunk downloads
# go on retrying, waiting 1, 2, 4, 8, 16, 16 ... s between tries, for this long after the first
# failure, then give up with DataStoreUnavailable (the run saves and exits for a requeue).
OUTAGE_ENV = "LIT_TITAN_DATA_OUTAGE_S"
_OUTAGE_S = 60.0


class DataStoreUnavailable(RuntimeError):
    """The S3 endpoint stopped answering in the middle of a run, after bounded retries.

    Not a ConfigError: the endpoint answered before (the manifest and indexes came from it), so the
    advice is to wait for it and continue, not to change a setting.
    """


def is_remote(path: str | os.PathLike[str]) -> bool:
    """``s3://...`` -> True, a local path -> False; another URL scheme is refused (ConfigError)."""
    text = str(path)
    if text.startswith("s3://"):
        return True
    if "://" in text:
        raise ConfigError(f"data.path={text!r}: only local paths and s3://BUCKET/PREFIX are supported")
    return False


def _split(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError(f"{url!r} is not an S3 URL: write s3://BUCKET/PREFIX")
    return parsed.netloc, parsed.path.lstrip("/")


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


class _Options:
    """``storage_options`` made hashable for the downloader cache, with the AWS_* variables it reads."""

    def __init__(self, storage_options: dict | None) -> None:
        try:
            self.options = dict(storage_options or {})
            env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
            self.cache_key = json.dumps([self.options, env], sort_keys=True, default=repr)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"data.storage_options must be a mapping of S3 client settings: {e}") from None

    def __hash__(self) -> int:
        return hash(self.cache_key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Options) and other.cache_key == self.cache_key


def _downloader(storage_options: dict | None, timeout_s: float, attempts: int) -> Any:
    downloader = _cached_downloader(os.getpid(), _Options(storage_options), timeout_s, attempts)
    try:
        downloader._client.client  # noqa: B018 - built lazily by litdata: surface a bad setting here, as one line
    except (TypeError, ValueError) as e:  # an unknown keyword, a malformed endpoint URL
        names = sorted(storage_options or {})  # names only: values may be secrets
        raise ConfigError(f"data.storage_options (keys {names}) is not a valid S3 client setting: {e}") from None
    return downloader


@functools.lru_cache(maxsize=16)
def _cached_downloader(pid: int, storage_options: _Options, timeout_s: float, attempts: int) -> Any:
    """One litdata downloader (boto3 client + obstore store) per process and settings.

    A cache, not state: building a boto3 client costs tens of milliseconds, paid once per
    process instead of once per chunk; ``pid`` in the key keeps forked children off it.
    """
    import botocore.config
    from litdata.streaming.downloader import S3Downloader
    from obstore.store import S3Store

    class _Downloader(S3Downloader):
        def _get_store(self, bucket: str) -> Any:
            store = super()._get_store(bucket)
            # litdata 0.2.76 builds its obstore S3Store without ``allow_http``, so against a
            # plain-http endpoint (on-premises stores, the loopback test server) the index loads
            # (boto3) and every chunk GET fails with "builder error" (reqwest: BadScheme).
            # Rebuild the store litdata made, same endpoint, region and credential provider,
            # with http allowed when the endpoint is http; litdata caches it in ``_store``.
            if str(store.config.get("endpoint", "")).startswith("http://") and not store.client_options.get(
                "allow_http"
            ):
                config = {k: v for k, v in store.config.items() if k != "bucket"}  # given positionally
                store = S3Store(
                    bucket,
                    config=config,
                    credential_provider=store.credential_provider,
                    client_options={**store.client_options, "allow_http": True},
                )
                self._store = store
            return store

    options = dict(storage_options.options)
    options.setdefault(
        "config",
        botocore.config.Config(
            connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": attempts, "mode": "standard"}
        ),
    )
    return _Downloader("s3://", "", [], storage_options=options)


def _client(storage_options: dict | None, timeout_s: float, attempts: int) -> Any:
    return _downloader(storage_options, timeout_s, attempts)._client.client


def _endpoint(storage_options: dict | None) -> str:
    return str(
        (storage_options or {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "the AWS default endpoint"
    )


def _explain(exc: BaseException, url: str, storage_options: dict | None) -> ConfigError | None:
    """The one-line ConfigError a user can act on, or None when ``exc`` is not a setting's fault."""
    from botocore import exceptions as be
    from obstore import exceptions as oe

    bucket, key = _split(url)
    endpoint = _endpoint(storage_options)
    unreachable = (
        f"cannot reach the S3 endpoint {endpoint} for {url} ({type(exc).__name__}): set "
        f"{_ENDPOINT_KEYS} to a reachable S3-compatible endpoint"
    )
    if isinstance(
        exc, (be.EndpointConnectionError, be.ConnectTimeoutError, be.ReadTimeoutError, be.ConnectionClosedError)
    ):
        return ConfigError(unreachable)
    if isinstance(exc, (be.NoCredentialsError, be.PartialCredentialsError, oe.UnauthenticatedError)):
        return ConfigError(f"no usable S3 credentials for {url}: set {_CREDENTIAL_KEYS}")
    if isinstance(exc, oe.NotFoundError):
        code = "NoSuchKey"
    elif isinstance(exc, oe.PermissionDeniedError):
        code = "AccessDenied"
    elif isinstance(exc, oe.GenericError) and "error sending request" in str(exc):
        return ConfigError(unreachable)
    elif isinstance(exc, be.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
    else:
        return None
    prefix = key.rsplit("/", 1)[0] if "/" in key else ""
    where = f"s3://{bucket}/{prefix}".rstrip("/")
    if code == "NoSuchBucket":
        return ConfigError(
            f"S3 bucket {bucket!r} does not exist at {endpoint}: create it, or fix data.path "
            f"({url}) or {_ENDPOINT_KEYS}"
        )
    if code in ("NoSuchKey", "404", "NotFound") and key.endswith(MANIFEST):
        return ConfigError(
            f"no {MANIFEST} under {where}: run `lit-titan prepare ... {shlex.quote(f'out={where}')}` first"
        )
    if code in ("NoSuchKey", "404", "NotFound"):
        return ConfigError(
            f"{url} does not exist: the prepared directory {where} is incomplete; run "
            f"`lit-titan prepare ... {shlex.quote(f'out={where}')}` again"
        )
    if code in (
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "403",
        "ExpiredToken",
        "InvalidToken",
        "Forbidden",
    ):
        return ConfigError(f"S3 refused the credentials for {url} ({code}) at {endpoint}: set {_CREDENTIAL_KEYS}")
    return ConfigError(
        f"S3 endpoint {endpoint} answered {code or type(exc).__name__} for {url}: is {_ENDPOINT_KEYS} "
        f"an S3-compatible endpoint?"
    )


def _unreachable(exc: BaseException) -> bool:
    """A connection that failed or timed out (the endpoint is down), not an answer from it."""
    from botocore import exceptions as be
    from obstore import exceptions as oe

    return isinstance(
        exc,
        (
            be.EndpointConnectionError,
            be.ConnectTimeoutError,
            be.ReadTimeoutError,
            be.ConnectionClosedError,
            ConnectionError,
            TimeoutError,
        ),
    ) or (isinstance(exc, oe.GenericError) and "error sending request" in str(exc))


def _raise(exc: BaseException, url: str, storage_options: dict | None) -> None:
    # boto3's upload_file wraps the ClientError that says why (S3UploadFailedError).
    explained = _explain(exc, url, storage_options) or (
        exc.__context__ and _explain(exc.__context__, url, storage_options)
    )
    if explained is not None:
        raise explained from None


def read_bytes(url: str, storage_options: dict | None = None, *, timeout_s: float = 20.0) -> bytes:
    """A small object (manifest.json, index.json, tokenizer.json), or a ConfigError in about ``timeout_s``."""
    bucket, key = _split(url)
    # Two attempts, each bounded by a quarter of the budget for connect and for read.
    client = _client(storage_options, timeout_s / 4, 2)
    try:
        response = client.get_object(Bucket=bucket, Key=key)
        with response["Body"] as body:
            return body.read()
    except Exception as e:
        _raise(e, url, storage_options)
        raise


def preflight(url: str, storage_options: dict | None = None, *, timeout_s: float = 20.0) -> None:
    """Before any process group: the endpoint answers, the bucket exists, the prefix holds a manifest."""
    data = read_bytes(_join(url, MANIFEST), storage_options, timeout_s=timeout_s)
    try:
        json.loads(data)
    except ValueError:
        raise ConfigError(
            f"{_join(url, MANIFEST)} is not JSON: run `lit-titan prepare ... {shlex.quote(f'out={url}')}` again"
        ) from None


def download(url: str, dest: Path, storage_options: dict | None = None, *, mid_run: bool = False) -> int:
    """Fetch one object to ``dest`` once per node; returns the bytes this call downloaded.

    ``mid_run``: the endpoint served this dataset already (its manifest and index), so a connection
    that fails is an outage: retried with backoff for ``LIT_TITAN_DATA_OUTAGE_S`` (60 s), then
    ``DataStoreUnavailable``. Otherwise it is a setting to fix: a ConfigError at once.

    Atomic (a process-unique temp file, then ``os.replace``) and under a blocking file lock next to
    ``dest``, so processes sharing a cache directory download each chunk once and a reader never
    sees half a file. 0 when ``dest`` was there already or another process fetched it meanwhile.
    """
    from filelock import FileLock

    dest = Path(dest)
    if dest.exists():
        return 0
    _split(url)
    dest.parent.mkdir(parents=True, exist_ok=True)
    downloader = _downloader(storage_options, _TRANSFER_TIMEOUT_S, _TRANSFER_ATTEMPTS)
    # Not ``dest + ".lock"``: litdata takes that one with timeout 0 and silently skips on contention.
    with FileLock(f"{dest}.fetch.lock"):
        if dest.exists():
            return 0
        budget_s = float(os.environ.get(OUTAGE_ENV) or _OUTAGE_S)
        first_failure, attempts = None, 0
        while True:
            tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            attempts += 1
            try:
                return _fetch(downloader, url, tmp, dest)
            except Exception as e:
                if not (mid_run and _unreachable(e)):
                    _raise(e, url, storage_options)
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                if now - first_failure >= budget_s:
                    raise DataStoreUnavailable(
                        f"the S3 endpoint {_endpoint(storage_options)} stopped answering mid-run ({url}: "
                        f"{type(e).__name__}, {attempts} attempts over {now - first_failure:.0f} s)"
                    ) from None
                time.sleep(min(2.0 ** (attempts - 1), 16.0, max(0.0, first_failure + budget_s - now)))
            finally:
                for leftover in (tmp, Path(f"{tmp}.lock")):
                    leftover.unlink(missing_ok=True)


def _fetch(downloader: Any, url: str, tmp: Path, dest: Path) -> int:
    # litdata writes into ``tmp`` via its own temp + rename (obstore GET, or boto3 after fork).
    downloader.download_file(url, str(tmp))
    if not tmp.exists():  # litdata swallows FileNotFoundError (a missing object, from obstore)
        bucket, key = _split(url)
        downloader._client.client.head_object(Bucket=bucket, Key=key)  # raises the real reason
        raise RuntimeError(f"litdata returned without writing {url}")
    size = tmp.stat().st_size
    os.replace(tmp, dest)
    return size


def check_bucket(url: str, storage_options: dict | None = None, *, timeout_s: float = 20.0) -> None:
    """Before preparing into ``url``: the endpoint answers, the credentials work, the bucket exists."""
    bucket, prefix = _split(url)
    client = _client(storage_options, timeout_s / 4, 2)
    try:
        client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except Exception as e:
        _raise(e, _join(url, MANIFEST), storage_options)
        raise


def upload_dir(local: Path, url: str, storage_options: dict | None = None) -> None:
    """Upload a prepared directory to ``url``; manifest.json goes last (its presence == complete).

    An older manifest at ``url`` is deleted first, so a prefix being overwritten is never taken
    for complete with a mix of old and new objects.
    """
    local = Path(local)
    if not (local / MANIFEST).is_file():
        raise ConfigError(f"{local} has no {MANIFEST}: it is not a prepared directory")
    bucket, prefix = _split(url)
    client = _client(storage_options, _TRANSFER_TIMEOUT_S, _TRANSFER_ATTEMPTS)

    def key_of(path: Path) -> str:
        return "/".join(p for p in (prefix.rstrip("/"), path.relative_to(local).as_posix()) if p)

    files = sorted(p for p in local.rglob("*") if p.is_file() and p != local / MANIFEST)
    try:
        client.delete_object(Bucket=bucket, Key=key_of(local / MANIFEST))
        with ThreadPoolExecutor(8) as pool:  # chunks in parallel; boto3 clients are thread-safe
            list(
                pool.map(
                    lambda p: client.upload_file(str(p), bucket, key_of(p)),
                    [p for p in files if p.name != "index.json"],
                )
            )
        # Then each index (never naming an object not there yet), then the manifest.
        for path in [p for p in files if p.name == "index.json"] + [local / MANIFEST]:
            client.upload_file(str(path), bucket, key_of(path))
    except Exception as e:
        _raise(e, _join(url, MANIFEST), storage_options)
        raise
