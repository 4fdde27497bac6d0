"""``lit-titan verify``'s procedure: shrink the job, train the layout and one process, judge.

Both sides run here, one after the other (the layout first: a layout that cannot start fails before the
reference costs anything), each in its own ``python -m lit_titan.cli.verify_side`` process, which Lightning's
launcher turns into the layout's ranks on this machine. Under a launcher (torchrun, srun) the command runs on
every rank of the job: the layout trains on those ranks, then rank 0 alone runs the reference in a process of
its own. The tests hand in their own ``Runner`` (their reused process worlds, a mutant applied to the layout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import OmegaConf

from lit_titan.config import ConfigError, compose
from lit_titan.verify.report import Verdict, judge
from lit_titan.verify.shrink import Shrunk, shrink

__all__ = ["KEYS", "Runner", "VerifyFailed", "run_verify", "split_keys", "subprocess_runner"]

# verify's own keys (read here, not by Hydra): steps compared, the precision both sides train in, table rows.
KEYS = {"verify.steps": "3", "verify.precision": "64-true", "verify.top": "10"}
# (side "reference" | "layout", overrides, run directory, steps to dump, known-norm step or None, processes)
Runner = Callable[[str, list[str], Path, list[int], "int | None", int], None]
# A launcher's variables: the reference, started by rank 0 of a launched job, is a job of one process.
_LAUNCHER_ENV = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LIT_TITAN_RUN_DIR",
)


class VerifyFailed(RuntimeError):
    """A side of the check did not finish (its log holds why); exit code 1."""

    exit_code = 1


def split_keys(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """verify's own keys (``KEYS``, defaults filled in) apart from the job's overrides."""
    mine, rest = dict(KEYS), []
    for item in argv:
        key = item.split("=", 1)[0].lstrip("+")
        if key.startswith("verify."):
            if key not in KEYS or "=" not in item:
                raise ConfigError(f"{item}: verify takes {', '.join(f'{k}=' for k in KEYS)} (and the job's overrides)")
            mine[key] = item.split("=", 1)[1]
        else:
            rest.append(item)
    if not mine["verify.steps"].isdigit() or int(mine["verify.steps"]) < 1:
        raise ConfigError(f"verify.steps={mine['verify.steps']}: give the optimizer steps to compare, e.g. 3")
    if mine["verify.precision"] not in ("64-true", "32-true"):
        raise ConfigError(f"verify.precision={mine['verify.precision']}: 64-true (default) or 32-true")
    return mine, rest


def prepare(argv: list[str], *, on_one_host: bool) -> tuple[dict[str, str], Shrunk, Path]:
    """Every check that needs no process: the job's config, its shrunk copy, its inputs, the memory it needs."""
    from lit_titan.config.inputs import check_inputs
    from lit_titan.verify.memory import check_memory

    if any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError("verify checks one job: drop -m (verify each point of a sweep on its own)")
    keys, overrides = split_keys(argv)
    cfg = compose(overrides, check=True)
    shrunk = shrink(
        cfg,
        overrides,
        steps=int(keys["verify.steps"]),
        precision=keys["verify.precision"],
        world_on_one_host=on_one_host,
    )
    check_memory(shrunk.spec, str(shrunk.cfg.cluster.accelerator))
    check_inputs(shrunk.cfg, shrunk.spec.model.vocab_size)
    base = cfg.run_dir or f"runs/{cfg.model.name}-verify-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(str(base)).expanduser().resolve()
    earlier = [out / side for side in ("layout", "reference") if (out / side).exists()]
    if earlier and on_one_host:  # under a launcher rank 0 may have begun writing while another rank checks
        raise ConfigError(f"run_dir={base}: holds an earlier check ({earlier[0]}); give another run_dir or remove it")
    return keys, shrunk, out


def run_verify(argv: list[str], runner: Runner | None = None, *, on_one_host: bool = True) -> Verdict:
    """Shrink the job of ``argv``, run both sides with ``runner`` (default: processes on this machine), judge.

    Writes ``RUN_DIR/verify.txt`` (the report with every parameter) and ``verify.csv``."""
    keys, shrunk, out = prepare(argv, on_one_host=on_one_host)
    steps = int(keys["verify.steps"])
    dims = shrunk.spec.dims
    runner = runner or subprocess_runner
    seconds = {}
    start = time.monotonic()
    runner("layout", shrunk.layout, out / "layout", list(range(steps)), steps, dims.world_size)
    seconds["layout"] = time.monotonic() - start
    start = time.monotonic()
    runner("reference", shrunk.reference, out / "reference", list(range(steps)), None, 1)
    seconds["reference"] = time.monotonic() - start
    verdict = judge(
        out / "reference",
        out / "layout",
        what=describe(shrunk),
        precision=keys["verify.precision"],
        steps=steps,
        clip=_clip(shrunk),
        notes=shrunk.notes,
    )
    verdict.seconds = seconds
    verdict.write(out)
    return verdict


def describe(shrunk: Shrunk) -> str:
    """The layout in a line: its degrees above one, the pipeline schedule and the context-parallel mode."""
    d, cfg = shrunk.spec.dims, shrunk.cfg
    degrees = [
        f"{k} {v}"
        for k, v in (
            ("pp", d.pp),
            ("dp_replicate", d.dp_replicate),
            ("dp_shard", d.dp_shard),
            ("cp", d.cp),
            ("tp", d.tp),
            ("ep", d.ep),
        )
        if v > 1
    ]
    if d.pp > 1:
        degrees[0] += f" ({cfg.parallel.pp_schedule})"
    if d.cp > 1:
        degrees = [f"{x} ({cfg.parallel.cp_mode})" if x.startswith("cp ") else x for x in degrees]
    return f"{' x '.join(degrees) or 'one rank'} ({d.world_size} ranks)"


def _clip(shrunk: Shrunk) -> float | None:
    value = OmegaConf.select(shrunk.cfg, "trainer.gradient_clip_val")
    return float(value) if value else None


def subprocess_runner(
    side: str, overrides: list[str], run_dir: Path, steps: list[int], known_norm_step: int | None, processes: int
) -> None:
    """One side in ``python -m lit_titan.cli.verify_side`` on this machine, its output in ``RUN_DIR/<side>.log``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{side}.log"
    print(f"verify: {side} ({processes} process{'es' if processes > 1 else ''}), log {log}", flush=True)
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and not k.startswith(("TORCHELASTIC_", "SLURM_"))
    }
    argv = [
        sys.executable,
        "-m",
        "lit_titan.cli.verify_side",
        str(run_dir),
        ",".join(map(str, steps)),
        "-" if known_norm_step is None else str(known_norm_step),
        *overrides,
    ]
    with open(log, "w") as f:
        code = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if code:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        raise VerifyFailed(f"the {side} run ended with exit code {code}: {tail[0] if tail else ''} (log: {log})")
