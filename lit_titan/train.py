"""``python -m lit_titan.train [hydra overrides]``: compose config, build the pieces, fit.

Thin on purpose: every decision lives in library code (config, strategy, module, data).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.cli import is_launcher_rank_zero
from lit_titan.config import RUN_DIR_ENV, ConfigError, default_run_dir, model_overrides, validate
from lit_titan.redact import redact, secrets_of, write_private


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix your input" (or, PreflightError, "fix your fleet"): one line, no traceback, exit code 2.

    A function, not a constant: their modules import torch and Lightning, which ``--help`` must not wait for.
    """
    from lit_titan.callbacks.preflight import PreflightError
    from lit_titan.checkpoint import CheckpointError
    from lit_titan.strategies.parallel_dims import LayoutError

    return (ConfigError, LayoutError, FileNotFoundError, CheckpointError, PreflightError)


def __getattr__(name: str) -> Any:  # PEP 562: `from lit_titan.train import USER_ERRORS` as before
    if name == "USER_ERRORS":
        return user_errors()
    raise AttributeError(f"module 'lit_titan.train' has no attribute {name!r}")


def resolve_run_dir(cfg: DictConfig) -> Path:
    """The run directory, identical in every process of the job.

    Child processes started by Lightning's launcher inherit the parent's environment, so the
    parent's choice travels to them through LIT_TITAN_RUN_DIR.
    """
    path = Path(default_run_dir(cfg.run_dir, cfg.model.name)).expanduser().resolve()
    os.environ[RUN_DIR_ENV] = str(path)
    return path


def with_flavor(cfg: DictConfig, args: Any) -> DictConfig:
    """A copy of ``cfg`` whose ``model.*`` keys left null hold the flavor's values (``args``, the ModelArgs).

    What config.yaml records: the model's shape is read there, not looked up in the flavor table of
    the lit-titan version that ran. The same ModelArgs result from it (export, calibration, resume).
    """
    from lit_titan.config import MODEL_ARG_KEYS

    out = cfg.copy()
    for key in MODEL_ARG_KEYS:
        if key in out.model and out.model[key] is None and getattr(args, key, None) is not None:
            out.model[key] = getattr(args, key)
    return out


def build_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """The ``logger`` nodes (conf/logger/, or a user's ``_target_``) through hydra.utils.instantiate.

    metrics.csv is part of the run's contract (docs, tests, the sweep summary read it), so a list
    without a CSVLogger writing to run_dir gets one.
    """
    from lightning.pytorch.loggers import CSVLogger

    from lit_titan.csv_logger import RunDirCSVLogger

    loggers: list = []
    credentials_in_argv = bool(secrets_of(sys.argv[1:]))
    for node in (cfg.get("logger") or {}).values():
        extra: dict[str, Any] = {}
        if "Wandb" in str(node.get("_target_", "")):
            if node.get("offline", False):
                os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network: `wandb sync` later
            if credentials_in_argv:
                # W&B copies the command line into its run metadata (uploaded by `wandb sync`), where no
                # redaction reaches: not recorded at all when it holds credentials (docs/data.md).
                settings = node.get("settings")
                settings = OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else \
                    dict(settings or {})
                extra.update(settings={**settings, "x_disable_meta": True}, _convert_="all")  # a dict, for wandb
        logger = _instantiate(node, **extra)
        _drop_wandb_anonymous(logger)
        loggers.append(logger)
    if not any(isinstance(lg, CSVLogger) and Path(lg.log_dir).resolve() == run_dir for lg in loggers):
        loggers.insert(0, RunDirCSVLogger(save_dir=str(run_dir), name="", version=""))
    return loggers


def _drop_wandb_anonymous(logger: Any) -> None:
    """Lightning's WandbLogger hands ``anonymous=None`` to ``wandb.init`` on every run, which wandb answers
    with "The anonymous setting has no effect and will be removed" (a deprecation of a key only Lightning
    passes: nothing a user can act on, and it prints outside Python's warnings, so known_warnings.py
    cannot hold it). Leaving the unset key out is what wandb asks for; a Lightning that stops passing it
    needs nothing here."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]


def build_strategy(cfg: DictConfig):
    from lit_titan.strategies import TitanStrategy

    p = cfg.parallel
    return TitanStrategy(timeout=timedelta(seconds=int(cfg.cluster.get("timeout_s", 1800))),
                         pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                         reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload,
                         grad_reduce_scatter=p.get("grad_reduce_scatter", "every_microbatch"),
                         loss_parallel=p.loss_parallel, pp_schedule=p.pp_schedule, pp_microbatches=p.pp_microbatches,
                         pp_stages_per_rank=p.get("pp_stages_per_rank"), pp_stages=p.get("pp_stages"),
                         tf32=bool(cfg.get("tf32", True)))


def resolve_resume(resume: str | None, run_dir: Path, expected: dict[str, Any] | None = None) -> str | None:
    """The checkpoint to resume from, checked before any process or model is built.

    ``auto``: the newest checkpoint in ``<run_dir>/checkpoints`` that passes validation (damaged
    ones are skipped with a message), or a fresh start when there is none: the setting for jobs a
    launcher restarts. ``PATH``: that checkpoint, refused with the reason if it is damaged.
    Every process also verifies the checksums (reads the chosen checkpoint once; on one node the
    page cache shares the reads): each rank must reach the same verdict on its own, as torchrun's
    ranks decide at the same time and a rank that resumed while another started fresh would hang.
    ``expected``: the config keys the checkpoint must have been saved with (``checkpoint.compat``).
    """
    from lit_titan.checkpoint import CheckpointError, latest_valid, published, set_aside, validate
    from lit_titan.checkpoint.compat import check_compatible
    from lit_titan.checkpoint.layout import CHECKSUMS, checkpoint_step

    if not resume:
        return None
    own = run_dir / "checkpoints"
    if str(resume) == "auto":
        ckpt, skipped = latest_valid(own, verify=True)
        for path, reason in skipped:
            _say(f"skipping damaged checkpoint: {reason}")
            if is_launcher_rank_zero():
                _say(f"moved it to {set_aside(path)} (kept for inspection; the run will save that step again)")
        _say(f"resume=auto: resuming from {ckpt}" if ckpt else
             f"resume=auto: no complete checkpoint in {run_dir / 'checkpoints'}; starting fresh")
        if ckpt and not (ckpt / CHECKSUMS).is_file():
            _say(f"warning: {ckpt} has no {CHECKSUMS} (written by an earlier version): loaded unverified")
        if ckpt and expected:
            check_compatible(ckpt, expected)
        return str(ckpt) if ckpt else None
    path = Path(str(resume)).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"resume={resume} does not exist; point resume= at a checkpoint directory such as "
                                f"<run_dir>/checkpoints/step-000100, or use resume=auto")
    try:
        validate(path, verify=True)
    except CheckpointError as err:
        others = [p.name for p in published(path.parent) if p != path]
        hint = f" (other checkpoints there: {', '.join(others[-3:])})" if others else ""
        raise CheckpointError(f"resume={resume} cannot be used: {err}; choose an earlier checkpoint{hint} or "
                              f"resume=auto") from None
    newer = [p.name for p in published(own) if (checkpoint_step(p) or 0) > (checkpoint_step(path) or 0)]
    if newer:  # the resumed run would save those steps again: never overwrite a checkpoint
        raise CheckpointError(f"run_dir {run_dir} already holds checkpoints newer than resume={resume} "
                              f"({', '.join(newer[-3:])}); resume from the newest with resume=auto, or pass a new "
                              f"run_dir= to branch off from this checkpoint")
    if not (path / CHECKSUMS).is_file():
        _say(f"warning: {path} has no {CHECKSUMS} (written by an earlier version): loaded unverified")
    if expected:
        check_compatible(path, expected)
    return str(path)


def continue_command(cfg: DictConfig, run_dir: Path, more_steps: bool = True) -> str | None:
    """The command line that trains this run ``trainer.max_steps`` more steps from its last checkpoint.

    ``more_steps=False``: the command that finishes this run (a preempted one), its steps unchanged.

    The user's own overrides (Hydra's record of this job), with ``run_dir`` and ``resume=auto``, the
    doubled ``trainer.max_steps``, and ``optim.total_steps`` pinned to this run's, so the learning
    rate schedule is the same and the new steps run at its final value. Credentials given as overrides
    appear as ``***`` (the user passes them again, or better from the environment). None when there will be no
    checkpoint to resume from, or outside a Hydra job (``train(cfg)`` called directly).
    """
    import shlex

    from hydra.core.hydra_config import HydraConfig

    if not cfg.checkpoint.enabled or not HydraConfig.initialized():
        return None
    steps, total = int(cfg.trainer.max_steps), int(cfg.optim.get("total_steps", cfg.trainer.max_steps))
    replaced = ("run_dir", "resume", *(("trainer.max_steps", "optim.total_steps") if more_steps else ()))
    hc = HydraConfig.get()
    # Hydra's record of an earlier command of this process (a job, or a --cfg display that never set
    # output_dir: it stays '???'), not ours: no command to print
    if OmegaConf.is_missing(hc.runtime, "output_dir") or Path(str(hc.runtime.output_dir)).resolve() != run_dir:
        return None
    own = [o for o in hc.overrides.task if o.lstrip("+~").split("=", 1)[0] not in replaced and not o.startswith("hydra")]
    config_dirs = [arg for source in hc.runtime.config_sources if source.provider == "command-line"
                   for arg in ("--config-dir", str(source.path).removeprefix("file://"))]  # the user's own groups
    own = redact(own, secrets_of(cfg, own))  # credentials as ***: the command is printed, into job logs
    more = [f"trainer.max_steps={2 * steps}", f"optim.total_steps={total}"] if more_steps else []
    return shlex.join(["python", "-m", "lit_titan.train", *config_dirs, *own, f"run_dir={run_dir}",
                       "resume=auto", *more])


def _tensorboard_dir(cfg: DictConfig) -> str | None:
    for node in (cfg.get("logger") or {}).values():
        if "TensorBoardLogger" in str(node.get("_target_", "")):
            return str(Path(str(node.save_dir)) / str(node.get("name") or "lightning_logs"))
    return None


def _say(message: str) -> None:
    if is_launcher_rank_zero():
        print(f"lit-titan: {message}", file=sys.stderr, flush=True)


def archive_metrics(run_dir: Path) -> None:
    """Keep the metrics of an earlier attempt: Lightning's CSVLogger deletes metrics.csv on start."""
    metrics = run_dir / "metrics.csv"
    if is_launcher_rank_zero() and metrics.is_file():
        n = len(list(run_dir.glob("metrics.attempt-*.csv")))
        metrics.rename(run_dir / f"metrics.attempt-{n}.csv")


def _instantiate(node: DictConfig, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, re-raising the target's own error (it names the fix) unwrapped."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, FileNotFoundError)):
            raise err.__cause__ from None
        raise


def train(cfg: DictConfig, callbacks: list | None = None) -> dict[str, Any]:
    """Run one training job from a composed config; returns the run summary."""
    import lightning as L

    from lit_titan.callbacks import Checkpointing, FaultInjection, RunSummary
    from lit_titan.callbacks.preemption import Preemption
    from lit_titan.data.progress import DataProgress
    from lit_titan.module import PretrainModule

    args, dims = validate(cfg)
    from lit_titan.schema_inputs import check_inputs, check_run_dir

    check_run_dir(cfg.run_dir)
    check_inputs(cfg, args.vocab_size)  # data, tokenizer, Float8 hardware: before any rank starts
    run_dir = resolve_run_dir(cfg)
    from lit_titan.checkpoint.compat import fingerprint

    run_keys = fingerprint(args, int(cfg.data.seq_len))
    resume = resolve_resume(cfg.resume, run_dir, run_keys)
    OmegaConf.update(cfg, "run_dir", str(run_dir))
    if is_launcher_rank_zero():
        run_dir.mkdir(parents=True, exist_ok=True)
        # credentials as ***, 0600; the model's shape with the flavor's values filled in
        write_private(run_dir / "config.yaml", OmegaConf.to_yaml(redact(with_flavor(cfg, args))))
    if resume:
        archive_metrics(run_dir)
    from lit_titan.observe import flight_recorder

    flight_recorder.enable(int(cfg.cluster.get("flight_recorder_entries", 0) or 0), run_dir / "hang")

    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    datamodule = _instantiate(cfg.data, data_dir=os.path.expanduser(str(cfg.data.data_dir)),
                              model_vocab_size=args.vocab_size, _convert_="all")
    module = PretrainModule(model=cfg.model.name, model_overrides=model_overrides(cfg),
                            optim=OmegaConf.to_container(cfg.optim, resolve=True), seed=int(cfg.seed),
                            init_from_hf=cfg.model.get("init_from_hf"),
                            loss_chunk_tokens=(cfg.get("loss") or {}).get("chunk_tokens", "auto"))

    global_batch = int(cfg.data.global_batch_size)
    micro = int(cfg.data.micro_batch_size or global_batch // dims.dp)
    summary = RunSummary(run_dir=str(run_dir), continue_command=continue_command(cfg, run_dir),
                         tensorboard_dir=_tensorboard_dir(cfg),
                         checkpoint_dir=str(run_dir / "checkpoints") if cfg.checkpoint.enabled else None)
    configured = [_instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    all_callbacks = [summary, DataProgress(), *configured, *(callbacks or [])]
    if (cfg.get("preflight") or {}).get("enabled"):  # first: it may end the job before the others act
        from lit_titan.callbacks.throughput import peak_flops
        from lit_titan.callbacks.preflight import Preflight

        peak = peak_flops(OmegaConf.to_container(cfg.cluster, resolve=True), str(cfg.precision)) / 1e12
        all_callbacks.insert(0, Preflight(str(run_dir), action=str(cfg.preflight.action),
                                          threshold=float(cfg.preflight.threshold), expected_tflops=peak or None,
                                          slow_rank=cfg.fault.get("slow_rank"),
                                          slow_factor=float(cfg.fault.get("slow_factor", 4.0)),
                                          slow_link=cfg.fault.get("slow_link"),
                                          only=bool(cfg.preflight.get("only", False))))
    guard = cfg.get("nonfinite") or {}
    if guard.get("enabled", True):  # before Checkpointing: a step's update is decided before its save
        from lit_titan.callbacks import NonFiniteGuard

        all_callbacks.append(NonFiniteGuard(action=str(guard.get("action", "stop")),
                                            max_consecutive_skips=int(guard.get("max_consecutive_skips", 5))))
    if cfg.checkpoint.enabled:
        c = cfg.checkpoint
        all_callbacks.append(Checkpointing(dirpath=str(run_dir / "checkpoints"), every_n_steps=int(c.every_n_steps),
                                           keep_last=int(c.keep_last), async_save=bool(c.async_save),
                                           fingerprint=run_keys))
    if cfg.fault.kill_rank is not None:
        all_callbacks.append(FaultInjection(kill_rank=int(cfg.fault.kill_rank), at_step=int(cfg.fault.at_step),
                                            during_save=bool(cfg.fault.during_save),
                                            save_error=cfg.fault.get("save_error"),
                                            stage_error=cfg.fault.get("stage_error"),
                                            pause=bool(cfg.fault.get("pause", False))))
    # SIGTERM/SIGUSR1 on any rank, or the data store gone: save, one line, the requeue exit code
    all_callbacks.append(Preemption(continue_command=continue_command(cfg, run_dir, more_steps=False)))
    t = cfg.trainer
    accumulation = global_batch // (dims.dp * micro)
    from lightning.pytorch.callbacks import ProgressBar

    from lit_titan.callbacks import StepProgressBar

    if t.enable_progress_bar and not any(isinstance(cb, ProgressBar) for cb in all_callbacks):
        # In optimizer steps; redrawn when a metrics row is written (a redraw reads the logged loss).
        all_callbacks.append(StepProgressBar(refresh_rate=max(1, int(t.log_every_n_steps))))
    trainer = L.Trainer(
        accelerator=cfg.cluster.accelerator, devices=cfg.cluster.devices, num_nodes=cfg.cluster.num_nodes,
        strategy=build_strategy(cfg), precision=cfg.precision, max_steps=int(t.max_steps),
        accumulate_grad_batches=accumulation, gradient_clip_val=t.gradient_clip_val,
        log_every_n_steps=t.log_every_n_steps, limit_val_batches=t.limit_val_batches,
        val_check_interval=t.val_check_interval if t.limit_val_batches else None,
        enable_progress_bar=t.enable_progress_bar, deterministic=t.deterministic,
        logger=build_loggers(cfg, run_dir), callbacks=all_callbacks, default_root_dir=str(run_dir),
        enable_checkpointing=False, use_distributed_sampler=False,  # Checkpointing replaces ModelCheckpoint
        enable_model_summary=False, profiler=_instantiate(cfg.profiler) if cfg.get("profiler") else None,
    )
    # Lightning picks MASTER_ADDR/PORT for a job it launches and leaves them in this process; a later
    # in-process run (notebooks, tests) must pick its own, or it may meet a port an earlier store holds.
    own_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    finally:
        for key, value in own_env.items():
            if value is None:
                os.environ.pop(key, None)
    return summary.summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The Hydra app (lit_titan/hydra_app.py): one run, a ``-m`` sweep, ``--cfg``, ``--info`` or ``--help``.

    Callable from Python and notebooks with a list of overrides; returns the run summary ({} for a
    sweep or a display command).
    """
    from lit_titan.hydra_app import run_app

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_app(argv, train)


if __name__ == "__main__":
    from lit_titan.cli import run_entry_point

    run_entry_point(main, user_errors, rank_failures=True)
