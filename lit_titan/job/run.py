"""One training run from a composed config: checks, run directory, resume, the pieces (job/build.py), fit.

Called by the train command (lit_titan/cli/train.py, under its Hydra app) on every rank, and by
notebooks and tests directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.config import JobSpec, validate
from lit_titan.config.compose import RUN_DIR_ENV, default_run_dir
from lit_titan.job.build import (
    build_callbacks,
    build_datamodule,
    build_loggers,
    build_module,
    build_strategy,
    instantiate,
    settings_group,
    trainer_arguments,
)
from lit_titan.job.ranks import is_launcher_rank_zero
from lit_titan.job.resume import archive_metrics, resolve_resume
from lit_titan.job.settings import ClusterConfig
from lit_titan.observe.redact import redact, write_private

__all__ = ["resolve_run_dir", "train", "with_flavor"]


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
    from lit_titan.models.registry import spec_of

    spec, out = spec_of(args), cfg.copy()
    for key in (k for k in spec.arg_keys if k not in spec.nullable_keys):
        if key in out.model and out.model[key] is None and getattr(args, key, None) is not None:
            out.model[key] = getattr(args, key)
    return out


def train(cfg: DictConfig, callbacks: list | None = None, spec: JobSpec | None = None) -> dict[str, Any]:
    """Run one training job from a composed config; returns the run summary.

    ``spec``: the config already checked, with its inputs (the train command's app checks every job
    before Hydra starts it); None: checked here.
    """
    import lightning as L

    if spec is None:
        from lit_titan.config.inputs import check_inputs, check_run_dir

        spec = validate(cfg)
        check_run_dir(cfg.run_dir)
        check_inputs(cfg, spec.model.vocab_size)  # data, tokenizer, Float8 hardware: before any rank starts
    args = spec.model
    run_dir = resolve_run_dir(cfg)
    from lit_titan.checkpoint.compat import fingerprint

    run_keys = fingerprint(args, spec.seq_len)
    rejoins = bool((cfg.get("fault_tolerance") or {}).get("enabled"))
    resume = resolve_resume(cfg.resume, run_dir, run_keys, rejoins=rejoins)
    OmegaConf.update(cfg, "run_dir", str(run_dir))
    if is_launcher_rank_zero():
        run_dir.mkdir(parents=True, exist_ok=True)
    # One launch per replica group: each launch has a rank 0, the job's is group 0's (fault_tolerance/launch.py).
    if is_launcher_rank_zero() and not (cfg.get("fault_tolerance") or {}).get("replica_id"):
        # credentials as ***, 0600; the model's shape with the flavor's values filled in
        write_private(run_dir / "config.yaml", OmegaConf.to_yaml(redact(with_flavor(cfg, args))))
    if resume:
        archive_metrics(run_dir)
    from lit_titan.observe import flight_recorder

    flight_recorder.enable(settings_group(cfg, "cluster", ClusterConfig).flight_recorder_entries, run_dir / "hang")

    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    datamodule = build_datamodule(cfg, spec)
    module = build_module(cfg, spec)
    summary, all_callbacks = build_callbacks(cfg, run_dir, run_keys, extra=callbacks or [])
    trainer = L.Trainer(
        **trainer_arguments(cfg, spec),
        strategy=build_strategy(cfg, spec),
        logger=build_loggers(cfg, run_dir),
        callbacks=all_callbacks,
        default_root_dir=str(run_dir),
        enable_checkpointing=False,
        use_distributed_sampler=False,  # Checkpointing replaces ModelCheckpoint
        enable_model_summary=False,
        profiler=instantiate(cfg.profiler) if cfg.get("profiler") else None,
    )
    # Lightning picks MASTER_ADDR/PORT for a job it launches and leaves them in this process; a later
    # in-process run (notebooks, tests) must pick its own, or it may meet a port an earlier store holds.
    own_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    strategy = trainer.strategy
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    finally:
        strategy.release_process_group()  # the job is done with its Trainer (the strategy keeps it for re-entry)
        for key, value in own_env.items():
            if value is None:
                os.environ.pop(key, None)
    return summary.summary
