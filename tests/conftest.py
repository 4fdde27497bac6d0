import os
import tempfile
from pathlib import Path

import pytest
import torch

from s3server import s3_server  # noqa: F401  (a real S3-compatible server on 127.0.0.1: tests/support/s3server.py)

# Variables of the user's shell that change what lit-titan, Lightning, torch or Hydra do (error
# display, rank and launcher detection, warnings, loggers, S3 endpoints): removed from this process
# before anything runs, so neither in-process runs nor the processes the tests start (which inherit
# this environment) depend on the shell the suite was started from. A test that needs one sets it
# itself (e.g. HYDRA_FULL_ERROR=1 in the env of the command it starts).
USER_SHELL_VARIABLES = (
    "HYDRA_FULL_ERROR",
    "PYTHONWARNINGS",
    "FORCE_COLOR",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_LOGS",
    "TORCH_SHOW_CPP_STACKTRACES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "GLOBAL_RANK",
)
USER_SHELL_PREFIXES = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_", "PL_", "WANDB_", "AWS_", "LIT_TITAN_")
KEPT = ("LIT_TITAN_CACHE",)  # a cache of tokenizers and shards: the user's is reused, it changes no result
for _name in [
    k for k in os.environ if k not in KEPT and (k in USER_SHELL_VARIABLES or k.startswith(USER_SHELL_PREFIXES))
]:
    del os.environ[_name]

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


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A test that fits its own Trainer in this process is done with it at its end: the strategy keeps its
    process group for the Trainer's return (validate after fit), so the test's end releases it, as
    ``lit_titan.train.main`` does, or the next test (the planner's fake group) would meet it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _shared_data_cache(tmp_path_factory):
    """One tokenizer + token cache for the whole session (subprocesses inherit the variable)."""
    if "LIT_TITAN_CACHE" not in os.environ:
        os.environ["LIT_TITAN_CACHE"] = str(tmp_path_factory.mktemp("lit_titan_cache"))
    yield


@pytest.fixture(scope="session")
def worlds(_shared_data_cache):
    """Gloo worlds of N processes, started once and reused by every multi-process case (tests/support/world.py)."""
    from world import Worlds

    pool = Worlds()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def parity_reference(worlds, tmp_path_factory):
    """The one-process run of tests/support/parity.py's shared config: every parity case of the session
    compares with it."""
    from parity import run_reference

    return run_reference(worlds, tmp_path_factory.mktemp("parity-reference"))


@pytest.fixture(scope="session")
def masked_reference(worlds, tmp_path_factory):
    """The one-process run of tests/support/user_modules.py's MaskedLabels (labels ignored unequally): the user-loss
    parity cases (tests/parity/test_user_loss.py) and the masked replica-fault case compare with it."""
    from parity import run_user_case

    return run_user_case(worlds, "MaskedLabels", ["cluster.devices=1"], tmp_path_factory.mktemp("masked-reference"))


@pytest.fixture(scope="session")
def moe_parity_reference(worlds, tmp_path_factory):
    """The one-process run of tests/support/moe_parity.py's tiny Qwen3-MoE: the MoE parity cases and mutants
    compare with it."""
    from moe_parity import run_moe_reference

    return run_moe_reference(worlds, tmp_path_factory.mktemp("moe-parity-reference"))


@pytest.fixture(scope="session")
def ep_parity_reference(worlds, tmp_path_factory):
    """The one-process run of the tiny Qwen3-MoE (``parity.MOE``): the expert-parallel cases (tests/parity/test_expert_parallel.py) and their mutants
    compare with it."""
    from parity import MOE, run_reference

    return run_reference(worlds, tmp_path_factory.mktemp("ep-parity-reference"), extra=MOE)


@pytest.fixture(scope="session")
def sequence_aux_reference(worlds, tmp_path_factory):
    """One process with the sequence-wise auxiliary loss (``parity.SEQUENCE_AUX``): the expert-parallel cases
    under accumulation or pp, and their mutants, compare with it."""
    from parity import MOE, SEQUENCE_AUX, run_reference

    return run_reference(worlds, tmp_path_factory.mktemp("moe-sequence-reference"), extra=[*MOE, *SEQUENCE_AUX])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
