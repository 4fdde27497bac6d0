"""The pieces of a run, each from its part of the config: strategy, loggers, data module, module, callbacks.

What ``lit_titan.train`` fits and what the planner rebuilds on a fake process group (planner/build.py),
so both take the same constructor calls. Torch and Lightning are imported inside the builders:
``--help`` imports this package's neighbours and must not wait for them.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.redact import secrets_of

__all__ = ["build_callbacks", "build_datamodule", "build_loggers", "build_module", "build_strategy", "instantiate",
           "tensorboard_dir"]


def instantiate(node: DictConfig, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, re-raising the target's own error (it names the fix) unwrapped."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, FileNotFoundError)):
            raise err.__cause__ from None
        raise


def build_loggers(loggers: DictConfig | None, run_dir: Path) -> list:
    """The ``logger`` nodes (conf/logger/, or a user's ``_target_``) through hydra.utils.instantiate.

    metrics.csv is part of the run's contract (docs, tests, the sweep summary read it), so a list
    without a CSVLogger writing to run_dir gets one.
    """
    from lightning.pytorch.loggers import CSVLogger

    from lit_titan.csv_logger import RunDirCSVLogger

    out: list = []
    credentials_in_argv = bool(secrets_of(sys.argv[1:]))
    for node in (loggers or {}).values():
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
        out.append(instantiate(node, **extra))
    if not any(isinstance(lg, CSVLogger) and Path(lg.log_dir).resolve() == run_dir for lg in out):
        out.insert(0, RunDirCSVLogger(save_dir=str(run_dir), name="", version=""))
    return out


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


def tensorboard_dir(cfg: DictConfig) -> str | None:
    for node in (cfg.get("logger") or {}).values():
        if "TensorBoardLogger" in str(node.get("_target_", "")):
            return str(Path(str(node.save_dir)) / str(node.get("name") or "lightning_logs"))
    return None


def build_datamodule(data: DictConfig, model_vocab_size: int) -> Any:
    """The ``data`` node's data module (``_target_``), its data_dir with ``~`` expanded."""
    return instantiate(data, data_dir=os.path.expanduser(str(data.data_dir)), model_vocab_size=model_vocab_size,
                       _convert_="all")


def build_module(cfg: DictConfig) -> Any:
    """The PretrainModule of the ``model``, ``optim``, ``loss`` and ``seed`` keys."""
    from lit_titan.config import model_overrides
    from lit_titan.module import PretrainModule

    return PretrainModule(model=cfg.model.name, model_overrides=model_overrides(cfg),
                          optim=OmegaConf.to_container(cfg.optim, resolve=True), seed=int(cfg.seed),
                          init_from_hf=cfg.model.get("init_from_hf"),
                          loss_chunk_tokens=(cfg.get("loss") or {}).get("chunk_tokens", "auto"))


def build_callbacks(cfg: DictConfig, run_dir: Path, run_keys: dict[str, Any], extra: list = ()) -> tuple[Any, list]:
    """The run's callbacks in the order they act, and the RunSummary among them (it holds the summary).

    ``run_keys``: the checkpoint fingerprint (``checkpoint.compat.fingerprint``); ``extra``: a caller's own.
    """
    from lit_titan.callbacks import Checkpointing, FaultInjection, RunSummary
    from lit_titan.callbacks.preemption import Preemption
    from lit_titan.data.progress import DataProgress
    from lit_titan.job.resume import continue_command

    summary = RunSummary(run_dir=str(run_dir), continue_command=continue_command(cfg, run_dir),
                         tensorboard_dir=tensorboard_dir(cfg),
                         checkpoint_dir=str(run_dir / "checkpoints") if cfg.checkpoint.enabled else None)
    configured = [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    all_callbacks = [summary, DataProgress(), *configured, *extra]
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
    from lightning.pytorch.callbacks import ProgressBar

    from lit_titan.callbacks import StepProgressBar

    if t.enable_progress_bar and not any(isinstance(cb, ProgressBar) for cb in all_callbacks):
        # In optimizer steps; redrawn when a metrics row is written (a redraw reads the logged loss).
        all_callbacks.append(StepProgressBar(refresh_rate=max(1, int(t.log_every_n_steps))))
    return summary, all_callbacks
