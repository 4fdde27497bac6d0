"""Running the real command line in subprocesses and reading what a run wrote."""

from __future__ import annotations

import csv
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

# A model small enough that an 8-process run takes seconds on 2 cores.
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=512",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.global_batch_size=8",
    "trainer.enable_progress_bar=false",
    "optim.warmup_steps=2",
    "cluster.timeout_s=180",
]


# Set in *this* process by in-process Lightning fits (MASTER_PORT ...) or by our own entry point:
# inherited, they would pin every later job to one port and one run directory.
_JOB_ENV_DROP = (
    "LIT_TITAN_RUN_DIR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "GLOBAL_RANK",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)

# README's first hour, step "verify your layout before you scale" (tests/commands/test_first_hour.py checks it is there)
README_VERIFY = (
    "lit-titan verify model.dim=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.vocab_size=512 "
    "data.seq_len=64 data.global_batch_size=8 data.max_bytes=300000 seed=0 cluster=cpu cluster.devices=4 parallel.tp=2"
)


def run_job(
    cmd: list[str],
    *,
    timeout: int = 600,
    env: dict | None = None,
    cwd: Path | str | None = None,
    allow_noise: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run a (possibly multi-process) job in a clean distributed environment and its own session.

    On a timeout the whole job (Lightning's child ranks too) is killed; otherwise a rank left
    waiting for a dead peer keeps our output pipes open and the test hangs. The output of a job
    that succeeds is read by ``noise`` (see ``Job.wait``).
    """
    return start_job(cmd, env=env, cwd=cwd).wait(timeout, allow_noise=allow_noise)


class Job:
    """A started ``run_job``: ``wait`` collects it once (and kills what it left behind)."""

    def __init__(self, cmd: list[str], env: dict | None, cwd: Path | str | None) -> None:
        # HYDRA_FULL_ERROR=1 in the user's shell turns one-line errors into tracebacks: a test that
        # wants it passes env itself.
        drop = _JOB_ENV_DROP if env is not None else (*_JOB_ENV_DROP, "HYDRA_FULL_ERROR")
        job_env = {k: v for k, v in (env or os.environ).items() if k not in drop}
        self.cmd = cmd
        self._popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env, cwd=cwd, start_new_session=True
        )
        self._result: subprocess.CompletedProcess | None = None

    def wait(self, timeout: int = 600, *, allow_noise: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """The finished job; one that exits 0 must print no warning, traceback or tip (``noise``).

        What the reused worlds check for every case (tests/support/world.py), here for the command lines: a
        test that expects such a line passes ``allow_noise=("text of that line",)`` and says why. A
        job that fails is the test's to judge (it reads the error it expects).
        """
        if self._result is None:
            popen = self._popen
            try:
                out, err = popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as timed_out:
                _kill_group(popen.pid)
                out, err = popen.communicate()
                raise AssertionError(
                    f"{' '.join(self.cmd)} timed out after {timeout}s:\n{out[-3000:]}\n{err[-6000:]}"
                ) from timed_out
            finally:
                _kill_group(popen.pid)
            self._result = subprocess.CompletedProcess(self.cmd, popen.returncode, out, err)
        if self._result.returncode == 0:
            found = [
                line
                for line in noise(self._result.stdout + "\n" + self._result.stderr)
                if not any(a in line for a in allow_noise)
            ]
            if found:
                raise AssertionError(
                    f"{' '.join(self.cmd)} succeeded but printed {len(found)} unexpected warning or traceback "
                    "line(s); fix the cause, or add a dependency's message a user cannot act on to "
                    "lit_titan/known_warnings.py:\n"
                    + "\n".join(found[:40])
                    + f"\n--- stdout ---\n{self._result.stdout[-3000:]}\n--- stderr ---\n{self._result.stderr[-6000:]}"
                )
        return self._result


def start_job(cmd: list[str], *, env: dict | None = None, cwd: Path | str | None = None) -> Job:
    """``run_job`` without the wait, for command lines a test file starts side by side.

    Why: a command line that ends on a config error is almost all interpreter start-up (imports,
    about 7 s of one core here); started together, such jobs use both cores instead of queuing.
    """
    return Job(cmd, env, cwd)


def run_cli(
    overrides: list[str],
    run_dir: Path,
    *,
    check: bool = True,
    timeout: int = 600,
    module: str = "lit_titan.train",
    allow_noise: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``python -m MODULE OVERRIDES run_dir=RUN_DIR``; a run that succeeds prints no warning (``Job.wait``)."""
    cmd = [sys.executable, "-m", module, *overrides, f"run_dir={run_dir}"]
    proc = run_job(cmd, timeout=timeout, allow_noise=allow_noise)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# Lines a user may see that mention a warning, each one asking the user to act (none on the default runs).
# A dependency's message that a user cannot act on belongs in lit_titan/known_warnings.py instead.
ACTIONABLE: tuple[str, ...] = ()
# "file.py:LINE: message" is how Python prints a warning; Lightning's format drops the category name.
# "warn" as a word or a category (UserWarning), not inside a path, a name or a key (test_warn_x,
# preflight.action=warn): the worlds' logs hold run directories and command lines (tests/support/world.py).
_NOISE = re.compile(r"(?<![\w./=-])warn(ing)?s?\b|\w+Warning\b|traceback|tip:|^\S+\.py:\d+: ", re.IGNORECASE)


def noise(output: str) -> list[str]:
    """Lines that mention a warning, a traceback or a tip, other than the documented actionable ones."""
    return [line for line in output.splitlines() if _NOISE.search(line) and not any(a in line for a in ACTIONABLE)]


def _kill_group(pgid: int) -> None:
    """Reap ranks the launcher left behind (e.g. when rank 0 died first)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(Path(run_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def losses(run_dir: Path) -> list[float]:
    return [float(r["train/loss"]) for r in read_metrics(run_dir) if r.get("train/loss")]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """Model weights of the run's newest checkpoint (a DCP directory), gathered into full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lit_titan.checkpoint import published

    out = Path(run_dir) / "final_params.pt"
    dcp_to_torch_save(published(Path(run_dir) / "checkpoints")[-1], out)
    return torch.load(out, weights_only=True)["state_dict"]


def assert_losses_match(got: list[float], ref: list[float], rtol: float) -> None:
    assert len(got) == len(ref) and len(ref) > 0, (len(got), len(ref))
    assert len(set(ref)) > 1, "the reference loss never changed: nothing was compared"
    worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    assert worst <= rtol, f"worst relative loss difference {worst:.3g} > {rtol}\n got={got}\n ref={ref}"


CORPUS_WORDS = [f"w{i}" for i in range(300)] + ["the", "of", "and", "def", "return", "(", ")", ":"]


def synthetic_corpus(root: Path, files: int, words: int, seed: int, tag: str = "") -> Path:
    """Many small deterministic documents: many chunks from little text."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (root / f"{tag}doc{i:04d}.txt").write_text(
            " ".join(rng.choice(CORPUS_WORDS) for _ in range(words)) + f" {tag}{i}\n"
        )
    return root
