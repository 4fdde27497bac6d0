"""``python -m lit_titan.train`` as a Hydra app: what a ``@hydra.main`` app accepts, callable as ``main(argv)``.

Why not ``@hydra.main``: it reads ``sys.argv`` and turns every error into ``sys.exit(1)`` with a
Hydra-formatted, multi-line message. lit-titan's entry point is also called from Python, notebooks
and the test suite's reused process groups with an argument list, and must report bad input as one
line (``lit-titan: error: ...``, exit code 2) *before* any directory, process or model exists. So
this module parses the flags with Hydra's own parser and drives the object ``@hydra.main`` builds,
``hydra._internal.hydra.Hydra`` (private; hydra-core 1.3): its ``run``/``multirun``/``show_cfg``/
``show_info``/``app_help`` are exactly what ``hydra._internal.utils._run_hydra`` calls, minus the
``run_and_report`` wrapper that prints and exits. Hydra's run directory *is* ``run_dir``
(conf/train.yaml's ``hydra.run.dir``); a sweep's points live in ``<sweep dir>/<n>``.

Lightning issue 11300: Lightning starts ranks 1..N-1 by re-running ``sys.argv``, so a sweep point
needing several processes, run inside the sweeping process, would make each child re-enter the whole
sweep. Such points run in a fresh ``python -m lit_titan.train`` process of their own.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from lit_titan.config import JobSpec, conf_dir, rules, validate
from lit_titan.config.compose import RUN_DIR_ENV
from lit_titan.config.inputs import check_inputs, check_run_dir
from lit_titan.config.schema_check import compose_error_line
from lit_titan.config.spec import world_size
from lit_titan.errors import ConfigError, one_line

CONFIG_NAME = "train"
SUBMITIT_LAUNCHERS = ("submitit_local", "submitit_slurm")
_CFG_TYPES = ("job", "hydra", "all")

# Hydra's deprecation note on conf/hydra/launcher/submitit_*.yaml: silenced in lit_titan/known_warnings.py.


def run_app(argv: list[str], train: Callable[[DictConfig], dict[str, Any]]) -> dict[str, Any]:
    """Parse ``argv`` like ``@hydra.main`` and run ``train`` under it; the run summary for one run, else ``{}``.

    ``train`` (``lit_titan.job.run.train``) is handed in, not imported: the app sits below the
    train command that calls it.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    parser = get_args_parser()
    args = parser.parse_args(_normalise(argv))
    config_name = args.config_name or CONFIG_NAME
    overrides = list(args.overrides)
    hydra = _create_hydra(args)
    from lit_titan.cli.usage import render  # generated from conf/ (+ --config-dir): lit_titan/cli/usage.py

    shown = {
        "help": lambda: print(render("train", extra_dirs=(args.config_dir,) if args.config_dir else ())),
        "hydra_help": lambda: hydra.hydra_help(config_name=config_name, args_parser=parser, args=args),
        "cfg": lambda: hydra.show_cfg(
            config_name=config_name, overrides=overrides, cfg_type=args.cfg, package=args.package, resolve=args.resolve
        ),
        "info": lambda: hydra.show_info(args.info, config_name=config_name, overrides=overrides),
        "shell_completion": lambda: hydra.shell_completion(config_name=config_name, overrides=overrides),
    }
    for flag, show in shown.items():
        if getattr(args, flag):
            with _one_line_errors(hydra, overrides):
                show()
            return {}

    # A submitit launcher runs through Hydra's multirun machinery, also for a single job.
    multirun = bool(args.multirun) or _launcher_choice(overrides) in SUBMITIT_LAUNCHERS
    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    specs = check(hydra, config_name, overrides, mode)
    # Hydra would write its record (.hydra/) with the credentials in plain text: it writes none
    # (output_subdir=null) and task() writes it, redacted, where the user asked (record_subdir).
    record = _record_subdir(overrides)
    if multirun:
        hydra.multirun(
            config_name=config_name,
            task_function=partial(task, train=train, record=record, specs=specs),
            overrides=[*overrides, "hydra.mode=MULTIRUN", _NO_HYDRA_RECORD],
        )
        return {}
    from lit_titan.job.ranks import is_launcher_rank_zero

    record = record if is_launcher_rank_zero() else None  # rank 0 records
    _outcome.clear()
    hydra.run(
        config_name=config_name,
        task_function=partial(task, train=train, record=record, specs=specs),
        overrides=[*overrides, "hydra.mode=RUN", _NO_HYDRA_RECORD],
    )
    if "error" in _outcome:  # re-raised here, not by Hydra, which would print a second line first
        raise _outcome.pop("error")
    return _outcome.pop("summary", {})


_outcome: dict[str, Any] = {}


_NO_HYDRA_RECORD = "hydra.output_subdir=null"


def _record_subdir(overrides: list[str]) -> str | None:
    """Where the user wants Hydra's record (``hydra.output_subdir``, default ``.hydra``); None: no record."""
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == "hydra.output_subdir"]
    value = given[-1].strip() if given else ".hydra"
    return None if value in ("", "null", "None") else value


def write_record(cfg: DictConfig, hc: Any, subdir: str) -> None:
    """Hydra's record of a job (``<output_dir>/<subdir>/{config,hydra,overrides}.yaml``), credentials redacted.

    The files Hydra's ``run_job`` would write, from the same objects, with the credentials as ``***``
    (lit_titan/observe/redact.py) and readable by the user only (they name data paths and endpoints).
    """
    from hydra.types import RunMode

    from lit_titan.observe.redact import private_dir, redact, secrets_of, write_private

    task_overrides = list(hc.overrides.task)
    secrets = secrets_of(cfg, task_overrides)
    hydra_cfg = OmegaConf.to_container(hc, resolve=False)
    hydra_cfg["output_subdir"] = subdir  # as if Hydra had written it: our own null is not the user's
    hydra_overrides = list(hydra_cfg["overrides"]["hydra"])
    if _NO_HYDRA_RECORD in hydra_overrides:
        hydra_overrides.reverse()
        hydra_overrides.remove(_NO_HYDRA_RECORD)
        hydra_cfg["overrides"]["hydra"] = hydra_overrides[::-1]
    out = private_dir(Path(str(hc.runtime.output_dir)) / subdir)
    write_private(out / "config.yaml", OmegaConf.to_yaml(redact(OmegaConf.to_container(cfg, resolve=False), secrets)))
    write_private(out / "hydra.yaml", OmegaConf.to_yaml({"hydra": redact(hydra_cfg, secrets)}))
    write_private(out / "overrides.yaml", OmegaConf.to_yaml(redact(task_overrides, secrets)))
    if hc.mode != RunMode.MULTIRUN:
        return
    # Hydra's sweeper wrote the whole config before the first job, with no hook in between: rewritten here.
    sweep_record = Path(str(hc.sweep.dir)) / "multirun.yaml"
    if sweep_record.is_file() and any(s in sweep_record.read_text() for s in secrets):
        write_private(sweep_record, OmegaConf.to_yaml(redact(OmegaConf.load(sweep_record), secrets)))


def task(
    cfg: DictConfig,
    train: Callable[..., dict[str, Any]],
    record: str | None = None,
    specs: dict[tuple[str, ...], JobSpec] | None = None,
) -> dict[str, Any]:
    """Hydra's task function: one job (a run, a sweep point, or one rank of a submitit job).

    ``record``: the subdirectory for Hydra's record of this job (written here, redacted), or None.
    ``specs``: each job's config as ``check`` validated it, by the job's overrides, so ``train`` does not
    check it again (a job not found there, e.g. one Hydra composed differently, is checked by ``train``).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lit_titan.job.ranks import is_launcher_rank_zero

    hc = HydraConfig.get()
    spec = (specs or {}).get(tuple(hc.overrides.task))

    def checked(cfg: DictConfig) -> dict[str, Any]:
        return train(cfg, spec=spec) if spec is not None else train(cfg)

    if os.environ.get("SUBMITIT_EXECUTOR"):  # one task of a submitit job = one rank
        _slurm_env_from_submitit_local()
    if record is not None and is_launcher_rank_zero():
        write_record(cfg, hc, record)
    with open_dict(cfg):
        cfg.run_dir = str(hc.runtime.output_dir)  # Hydra's run directory is the run's run_dir
    if hc.mode != RunMode.MULTIRUN:
        try:
            _outcome["summary"] = checked(cfg)
        except Exception as err:  # noqa: BLE001 - handed back to run_app, raised there
            _outcome["error"] = err
        return _outcome.get("summary", {})
    from lit_titan.observe.redact import redact, secrets_of

    shown = redact(list(hc.overrides.task), secrets_of(cfg))
    print(f"lit-titan: sweep job {hc.job.num}: {' '.join(shown)} -> {cfg.run_dir}", flush=True)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        summary = checked(cfg)
        print(
            f"lit-titan: task {os.environ.get('SLURM_PROCID')} of {os.environ.get('SLURM_NTASKS')} trained under "
            f"{summary.get('cluster_environment')}",
            flush=True,
        )
        return summary
    if world_size(cfg) > 1:  # Lightning issue 11300: several processes -> a fresh process group of its own
        return _run_point_in_subprocess(list(hc.overrides.task), Path(cfg.run_dir))
    saved = os.environ.get(RUN_DIR_ENV)
    try:
        return checked(cfg)
    finally:  # the next point (or a later main() call in this process) must not inherit this run_dir
        if saved is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = saved


def check(hydra: Any, config_name: str, overrides: list[str], mode: Any) -> dict[tuple[str, ...], JobSpec]:
    """Compose and validate every job of the command line (each sweep point) before any of them starts;
    each job's JobSpec by its overrides (what Hydra hands the task as ``overrides.task``).

    Also what the jobs point at (data, tokenizer, run_dir, Float8 hardware: lit_titan/config/inputs.py),
    so nothing, not even Hydra's run directory, is created for a job that cannot run. The answer is the
    same on every rank of a launched job, so only the first prints it (job.ranks.report_user_error).
    """
    try:
        specs = _check(hydra, config_name, overrides, mode)
    except ValueError as err:  # ConfigError, LayoutError
        err.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise
    return specs


def _check(hydra: Any, config_name: str, overrides: list[str], mode: Any) -> dict[tuple[str, ...], JobSpec]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from hydra.types import RunMode

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(
            compose_error_line(_flat(err), overrides, lambda group: []) or f"cannot parse the overrides: {_flat(err)}"
        ) from None
    own = [o.input_line for o in parsed if _is_hydra_key(o.key_or_group)]
    job = [o for o in parsed if not _is_hydra_key(o.key_or_group)]
    for o in job:  # Hydra's own answer to `optim=1` is a ValueError without the override's name
        if not o.is_sweep_override() and not isinstance(o.value(), (str, list)):
            options = hydra.config_loader.get_group_options(o.key_or_group)
            if options:
                raise ConfigError(
                    f"{o.input_line}: {o.key_or_group} is a config group; choose one of "
                    f"{', '.join(options)} (or set one of its keys: {o.key_or_group}.KEY=VALUE)"
                )
    if mode == RunMode.MULTIRUN:
        points = [point for batch in BasicSweeper.split_arguments(job, None) for point in batch]
    else:
        sweeps = [o.input_line for o in job if o.is_sweep_override()]
        if sweeps:
            raise ConfigError(f"{sweeps[0]} lists several values: add -m (--multirun) to run one job per value")
        points = [[o.input_line for o in job]]
    specs: dict[tuple[str, ...], JobSpec] = {}
    for point in points:
        with _one_line_errors(hydra, [*overrides, *own, *point]):  # the user's own spelling first
            full = hydra.compose_config(
                config_name=config_name, overrides=[*own, *point], run_mode=mode, with_log_configuration=False
            )
        launcher = (
            OmegaConf.create(OmegaConf.to_container(full.hydra.launcher, resolve=True))
            if mode == RunMode.MULTIRUN
            else None
        )
        job_cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
        spec = validate(job_cfg)
        rules.launcher(job_cfg, launcher)
        check_run_dir(job_cfg.get("run_dir"))
        check_inputs(job_cfg, spec.model.vocab_size)
        specs[tuple(point)] = spec
    return specs


class SweepSummary(Callback):
    """Writes ``<sweep dir>/summary.csv`` when a sweep ends: each point's overrides, run_dir and final loss."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        path = write_sweep_summary(Path(str(config.hydra.sweep.dir)))
        print(f"lit-titan: sweep summary: {path}", flush=True)


def write_sweep_summary(sweep_dir: Path) -> Path:
    """summary.csv from what each point wrote (``.hydra/overrides.yaml``, ``metrics.csv``): works for any launcher."""
    points = sorted(
        (p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")),
        key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name),
    )
    out = sweep_dir / "summary.csv"
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job", "overrides", "run_dir", "steps", "final_loss"])
        for point in points:
            overrides = OmegaConf.load(point / ".hydra" / "overrides.yaml")
            steps, loss = _last_loss(point / "metrics.csv")
            writer.writerow([point.name, " ".join(overrides), str(point.resolve()), steps, loss])
    return out


def _last_loss(metrics: Path) -> tuple[str, str]:
    if not metrics.is_file():
        return "", ""  # the point failed before its first metrics row
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    return (str(int(rows[-1]["step"]) + 1), rows[-1]["train/loss"]) if rows else ("0", "")


def _run_point_in_subprocess(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One sweep point as ``python -m lit_titan.train OVERRIDES run_dir=RUN_DIR`` (its own process group).

    ``hydra.output_subdir=null``: the point's .hydra/ record is the sweep's (written before this runs).
    """
    cmd = [sys.executable, "-m", "lit_titan.train", *overrides, f"run_dir={run_dir}", "hydra.output_subdir=null"]
    # The distributed variables of this process (if any) must not pin the child's job.
    drop = {
        RUN_DIR_ENV,
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GLOBAL_RANK",
    }
    env = {k: v for k, v in os.environ.items() if k not in drop}
    code = subprocess.run(cmd, env=env, check=False).returncode
    if code != 0:
        raise RuntimeError(f"sweep point {run_dir} failed (exit code {code}); its output is above")
    steps, loss = _last_loss(run_dir / "metrics.csv")
    return {"run_dir": str(run_dir), "steps": int(steps or 0), "final_loss": float(loss) if loss else None}


def _slurm_env_from_submitit_local() -> None:
    """Under submitit's *local* executor, describe this task to Lightning as srun would.

    submitit's local executor starts ``tasks_per_node`` processes and tells each its place in
    SUBMITIT_LOCAL_* variables; srun sets SLURM_* ones. Translating the first into the second makes
    Lightning pick its SLURMEnvironment in both cases, so CI exercises the code path a Slurm job runs.
    Under Slurm (SUBMITIT_EXECUTOR=slurm) srun has set them already: nothing changes.
    """
    env = os.environ
    if env.get("SUBMITIT_EXECUTOR") != "local":
        return
    ntasks = env["SUBMITIT_LOCAL_NTASKS"]
    env.update(
        SLURM_NTASKS=ntasks,
        SLURM_NTASKS_PER_NODE=ntasks,
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_PROCID=env["SUBMITIT_LOCAL_GLOBALID"],
        SLURM_LOCALID=env["SUBMITIT_LOCAL_LOCALID"],
        SLURM_JOB_ID=env["SUBMITIT_LOCAL_JOB_ID"],
        SLURM_JOB_NAME="lit-titan",
        SLURM_NODELIST="127.0.0.1",
    )


# ---- parsing, composing, errors ------------------------------------------------------------------
def _normalise(argv: list[str]) -> list[str]:
    """lit-titan's earlier ``--cfg [overrides]`` (no job|hydra|all) keeps meaning: the resolved job config."""
    out = list(argv)
    for flag in ("--cfg", "-c"):
        if flag in out:
            i = out.index(flag)
            if i + 1 == len(out) or out[i + 1] not in _CFG_TYPES:
                out.insert(i + 1, "job")
                if "--resolve" not in out:
                    out.append("--resolve")
    return out


def _create_hydra(args: Any) -> Any:
    """The object ``@hydra.main`` builds: our conf/ as the primary config dir, plus ``--config-dir``."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    primary = args.config_path or str(conf_dir())
    search_path = create_automatic_config_search_path(None, None, primary)
    if args.config_dir is not None:
        extra = Path(args.config_dir).expanduser().resolve()
        if not extra.is_dir():
            raise ConfigError(
                f"--config-dir {args.config_dir}: no such directory; pass a directory holding your "
                f"config groups, e.g. DIR/model/my_llama.yaml (then model=my_llama)"
            )
        # Where @hydra.main puts it (hydra._internal.utils._run_hydra): before the plugins' structured configs.
        search_path.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    return Hydra.create_main_hydra2(task_name=CONFIG_NAME, config_search_path=search_path)


class _one_line_errors:
    """Hydra/OmegaConf composition errors as one ConfigError line naming the override to change."""

    def __init__(self, hydra: Any, overrides: list[str]) -> None:
        self.hydra, self.overrides = hydra, overrides

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> bool:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if err is None or not isinstance(err, (HydraException, OmegaConfBaseException)):
            return False
        raise ConfigError(self._explain(err)) from None

    def _explain(self, err: BaseException) -> str:

        text = f"{err} {err.__cause__ or ''}"
        launcher = _launcher_choice(self.overrides)
        if launcher is not None and "hydra/launcher" in text:
            options = self.hydra.config_loader.get_group_options("hydra/launcher")
            return f"hydra/launcher={launcher}: not a launcher; choose one of {', '.join(options)}"
        line = compose_error_line(text, self.overrides, self.hydra.config_loader.get_group_options)
        if line:
            return line
        return _flat(err)


def _flat(err: BaseException) -> str:
    """Hydra's error and its cause (where Hydra puts the override it could not parse) on one line."""
    return one_line(f"{err} {err.__cause__ or ''}")


def _is_hydra_key(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _launcher_choice(overrides: list[str]) -> str | None:
    choice = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("hydra/launcher=")), None)
    return choice
