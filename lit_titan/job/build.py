"""The pieces of a run, each from its part of the config: strategy, loggers, data module, module, callbacks.

What ``lit_titan.train`` fits and what the planner rebuilds on a fake process group (planner/build.py),
so both take the same constructor calls. Torch and Lightning are imported inside the builders:
``--help`` imports this package's neighbours and must not wait for them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from lit_titan.callbacks.settings import CheckpointConfig, FaultConfig, NonFiniteConfig, PreflightConfig
from lit_titan.fault_tolerance.settings import FaultToleranceConfig
from lit_titan.job.settings import ClusterConfig, LossConfig, TrainerConfig
from lit_titan.observe.redact import secrets_of

if TYPE_CHECKING:
    from lit_titan.config import JobSpec

T = TypeVar("T")

__all__ = [
    "build_callbacks",
    "build_datamodule",
    "build_loggers",
    "build_module",
    "build_strategy",
    "instantiate",
    "settings_group",
    "tensorboard_dir",
    "trainer_arguments",
]


def settings_group(cfg: DictConfig, name: str, cls: type[T]) -> T:
    """The ``name`` group of a checked config as its component's settings dataclass (absent: the defaults,
    e.g. a ``config.yaml`` written before the group existed)."""
    node = cfg.get(name)
    return cls(**OmegaConf.to_container(node, resolve=True)) if node is not None else cls()


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


def build_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """The ``logger`` nodes (conf/logger/, or a user's ``_target_``) through hydra.utils.instantiate.

    metrics.csv is part of the run's contract (docs, tests, the sweep summary read it), so a list
    without a CSVLogger writing to run_dir gets one.
    """
    from lightning.pytorch.loggers import CSVLogger

    from lit_titan.observe.csv_logger import RunDirCSVLogger

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
                settings = (
                    OmegaConf.to_container(settings, resolve=True)
                    if OmegaConf.is_config(settings)
                    else dict(settings or {})
                )
                extra.update(settings={**settings, "x_disable_meta": True}, _convert_="all")  # a dict, for wandb
        logger = instantiate(node, **extra)
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


def build_strategy(cfg: DictConfig, spec: JobSpec | None = None):
    """The ``parallel`` group is ``TitanStrategy``'s own settings (``ParallelConfig``); ``spec``: the
    checked job, whose resolved degrees the strategy takes as they are (None: it resolves them)."""
    from lit_titan.strategies import ParallelConfig, TitanStrategy

    return TitanStrategy(
        ParallelConfig(**OmegaConf.to_container(cfg.parallel, resolve=True)),
        dims=spec.dims if spec is not None else None,
        tf32=bool(cfg.get("tf32", True)),
        timeout=timedelta(seconds=settings_group(cfg, "cluster", ClusterConfig).timeout_s),
        fault_tolerance=settings_group(cfg, "fault_tolerance", FaultToleranceConfig),
    )


def trainer_arguments(cfg: DictConfig, spec: JobSpec) -> dict[str, Any]:
    """Lightning ``Trainer``'s arguments from the ``trainer`` group (``TrainerConfig``: Trainer arguments by
    their own names, passed on as they are), the cluster's devices and the spec's precision and accumulation."""
    trainer, cluster = settings_group(cfg, "trainer", TrainerConfig), settings_group(cfg, "cluster", ClusterConfig)
    return {
        **asdict(trainer),
        "val_check_interval": trainer.val_check_interval if trainer.limit_val_batches else None,
        "accelerator": cluster.accelerator,
        "devices": cluster.devices,
        "num_nodes": cluster.num_nodes,
        **precision_arguments(spec.precision),
        # one Lightning batch is a rank's whole step: TitanStrategy's step runner makes the micro-batches
        "accumulate_grad_batches": 1,
    }


def precision_arguments(precision: str) -> dict[str, Any]:
    """The Trainer's precision: ``64-true`` as Lightning's ``DoublePrecision`` plugin, which Lightning's flag check
    refuses for a ``ModelParallelStrategy`` (TitanStrategy's base) though nothing in it needs fewer bits."""
    if precision == "64-true":
        from lightning.pytorch.plugins.precision import DoublePrecision

        return {"plugins": [DoublePrecision()]}
    return {"precision": precision}


def tensorboard_dir(cfg: DictConfig) -> str | None:
    for node in (cfg.get("logger") or {}).values():
        if "TensorBoardLogger" in str(node.get("_target_", "")):
            return str(Path(str(node.save_dir)) / str(node.get("name") or "lightning_logs"))
    return None


def build_datamodule(cfg: DictConfig, spec: JobSpec) -> Any:
    """The ``data`` node's data module (``_target_``), its data_dir with ``~`` expanded; it checks the
    global batch against its data-parallel size with the same ``BatchLayout`` the spec holds."""
    return instantiate(
        cfg.data,
        data_dir=os.path.expanduser(str(cfg.data.data_dir)),
        model_vocab_size=spec.model.vocab_size,
        _convert_="all",
    )


def build_module(cfg: DictConfig, spec: JobSpec | None = None) -> Any:
    """The ``module`` node's class (``PretrainModule`` or the user's subclass) built from the ``model``, ``optim``,
    ``loss`` and ``seed`` keys, ``spec``'s micro-batch (the step runner's) and the node's own arguments."""
    from lit_titan.config.module_node import module_arguments, module_class, module_node
    from lit_titan.config.spec import model_overrides

    node = module_node(cfg)
    return module_class(node["_target_"])(
        model=cfg.model.name,
        model_overrides=model_overrides(cfg),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        seed=int(cfg.seed),
        init_from_hf=cfg.model.get("init_from_hf"),
        loss_chunk_tokens=settings_group(cfg, "loss", LossConfig).chunk_tokens,
        step_micro_batch=spec.batch.micro if spec is not None else None,
        **module_arguments(node),
    )


def build_callbacks(cfg: DictConfig, run_dir: Path, run_keys: dict[str, Any], extra: list = ()) -> tuple[Any, list]:
    """The run's callbacks in the order they act, and the RunSummary among them (it holds the summary).

    ``run_keys``: the checkpoint fingerprint (``checkpoint.compat.fingerprint``); ``extra``: a caller's own.
    """
    from lit_titan.callbacks import Checkpointing, FaultInjection, RunSummary
    from lit_titan.callbacks.preemption import Preemption
    from lit_titan.data.progress import DataProgress
    from lit_titan.job.resume import continue_command

    checkpoint = settings_group(cfg, "checkpoint", CheckpointConfig)
    fault = settings_group(cfg, "fault", FaultConfig)
    preflight = settings_group(cfg, "preflight", PreflightConfig)
    guard = settings_group(cfg, "nonfinite", NonFiniteConfig)
    summary = RunSummary(
        run_dir=str(run_dir),
        continue_command=continue_command(cfg, run_dir),
        tensorboard_dir=tensorboard_dir(cfg),
        checkpoint_dir=str(run_dir / "checkpoints") if checkpoint.enabled else None,
    )
    configured = [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    all_callbacks = [summary, DataProgress(), *configured, *extra]
    if preflight.enabled:  # first: it may end the job before the others act
        from lit_titan.callbacks.preflight import Preflight
        from lit_titan.observe.throughput import peak_flops

        peak = peak_flops(OmegaConf.to_container(cfg.cluster, resolve=True), str(cfg.precision)) / 1e12
        all_callbacks.insert(0, Preflight(str(run_dir), preflight, drill=fault, expected_tflops=peak or None))
    if guard.enabled:  # before Checkpointing: a step's update is decided before its save
        from lit_titan.callbacks import NonFiniteGuard

        all_callbacks.append(NonFiniteGuard(guard))
    if checkpoint.enabled:
        all_callbacks.append(Checkpointing(str(run_dir / "checkpoints"), checkpoint, fingerprint=run_keys))
    if fault.kill_rank is not None:
        all_callbacks.append(FaultInjection(fault))
    # SIGTERM/SIGUSR1 on any rank, or the data store gone: save, one line, the requeue exit code
    all_callbacks.append(Preemption(continue_command=continue_command(cfg, run_dir, more_steps=False)))
    t = settings_group(cfg, "trainer", TrainerConfig)
    from lightning.pytorch.callbacks import ProgressBar

    from lit_titan.callbacks import StepProgressBar

    if t.enable_progress_bar and not any(isinstance(cb, ProgressBar) for cb in all_callbacks):
        # In optimizer steps; redrawn when a metrics row is written (a redraw reads the logged loss).
        all_callbacks.append(StepProgressBar(refresh_rate=max(1, t.log_every_n_steps)))
    return summary, all_callbacks
