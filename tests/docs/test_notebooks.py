"""The notebooks in notebooks/ run top to bottom in a fresh kernel, and are stored without outputs."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from helpers import _JOB_ENV_DROP, noise
from paths import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_quickstart", "02_subclassing", "03_planning_a_fleet_run", "04_notebook_to_parallel"]
CELL_TIMEOUT_S = 300
# Each notebook takes about a minute or less on 2 idle cores; this is a backstop against a hang.
NOTEBOOK_TIMEOUT_S = 600


def test_the_four_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} hold outputs; clear them before committing "
        f"(jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)})"
    )


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory) -> str:
    """A kernelspec for *this* interpreter, so a system-wide `python3` kernel cannot shadow the venv."""
    from ipykernel.kernelspec import write_kernel_spec

    share = tmp_path_factory.mktemp("jupyter")
    name = "lit-titan-tests"
    write_kernel_spec(
        share / "kernels" / name,
        overrides={
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": name,
        },
    )
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(share), *([old] if old else [])])
    yield name
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


# Notebooks 01-03 run in one kernel process each, mostly one core's worth of Python (imports, a tiny
# model): side by side they share the two cores instead of queuing. Notebook 04 starts a 4-process run
# of its own and runs alone.
SIDE_BY_SIDE = EXPECTED[:3]


@pytest.fixture(scope="module")
def executed(kernel_name, tmp_path_factory):
    """``run(path)``: the executed notebook, or the error its execution raised. The first call for a
    notebook of SIDE_BY_SIDE executes all of them at once (one asyncio loop, a kernel each)."""
    import asyncio

    import nbformat
    from nbclient import NotebookClient

    done: dict[str, tuple] = {}
    # A fresh kernel in a clean distributed environment, sharing the session's data cache
    # (LIT_TITAN_CACHE, tests/conftest.py); runs/ lands in the kernel's working directory.
    env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV_DROP}
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # OpenMP threads that spin-wait slow down ~10x when the cores are shared (other jobs, the
    # 4-process run of notebook 4); passive waiting costs nothing on idle cores.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    async def one(path: Path):
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(
            nb,
            timeout=CELL_TIMEOUT_S,
            kernel_name=kernel_name,
            resources={"metadata": {"path": str(tmp_path_factory.mktemp(path.stem))}},
        )
        start = time.perf_counter()
        try:
            await client.async_execute(env=env)  # raises CellExecutionError, with the cell and its traceback
        except Exception as err:  # noqa: BLE001 - re-raised in that notebook's own test
            return path.stem, (None, err, time.perf_counter() - start)
        return path.stem, (nb, None, time.perf_counter() - start)

    async def several(paths: list[Path]):
        return dict(await asyncio.gather(*(one(p) for p in paths)))

    def run(path: Path):
        if path.stem not in done:
            group = [p for p in NOTEBOOKS if p.stem in SIDE_BY_SIDE] if path.stem in SIDE_BY_SIDE else [path]
            done.update(asyncio.run(asyncio.wait_for(several(group), NOTEBOOK_TIMEOUT_S)))
        return done[path.stem]

    return run


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, executed):
    nb, err, elapsed = executed(path)
    print(
        f"{path.name}: {elapsed:.1f} s"
        + (" (side by side with the other one-process notebooks)" if path.stem in SIDE_BY_SIDE else "")
    )
    if err is not None:
        raise err
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    shown = "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream"
    )
    assert noise(shown) == [], shown[-4000:]  # no warning a user cannot act on
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
