import os
import tempfile
from pathlib import Path

import pytest
import torch
from s3server import s3_server  # noqa: F401  (a real S3-compatible server on 127.0.0.1: tests/s3server.py)

# One inductor cache for the whole suite and every process it starts (worlds, command lines): the
# first compile of a graph pays the C++ build, every later one (other ranks, the next run of the
# suite on this machine) loads it. Outside pytest's per-session temporary directory on purpose.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "lit-titan-tests-inductor"))


@pytest.fixture(autouse=True)
def _known_warnings_only():
    """pytest replaces the warning filters around each test (and shows every DeprecationWarning):
    re-add lit_titan's known-warnings list inside it, the one place a dependency's warning is
    silenced (pyproject.toml has no blanket filter). Any other warning shows in pytest's summary."""
    from lit_titan import known_warnings

    known_warnings.add_warning_filters()
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_data_cache(tmp_path_factory):
    """One tokenizer + token cache for the whole session (subprocesses inherit the variable)."""
    if "LIT_TITAN_CACHE" not in os.environ:
        os.environ["LIT_TITAN_CACHE"] = str(tmp_path_factory.mktemp("lit_titan_cache"))
    yield


@pytest.fixture(scope="session")
def worlds(_shared_data_cache):
    """Gloo worlds of N processes, started once and reused by every multi-process case (tests/world.py)."""
    from world import Worlds

    pool = Worlds()
    yield pool
    pool.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
