"""Where a run continues from: the checkpoint to resume (checked before any process starts), and the
command line that continues a run later.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.job.ranks import is_launcher_rank_zero
from lit_titan.observe.redact import redact, secrets_of

__all__ = ["archive_metrics", "continue_command", "resolve_resume"]


def resolve_resume(
    resume: str | None, run_dir: Path, expected: dict[str, Any] | None = None, *, rejoins: bool = False
) -> str | None:
    """The checkpoint to resume from, checked before any process or model is built.

    ``auto``: the newest checkpoint in ``<run_dir>/checkpoints`` that passes validation (damaged
    ones are skipped with a message), or a fresh start when there is none: the setting for jobs a
    launcher restarts. ``PATH``: that checkpoint, refused with the reason if it is damaged.
    Every process also verifies the checksums (reads the chosen checkpoint once; on one node the
    page cache shares the reads): each rank must reach the same verdict on its own, as torchrun's
    ranks decide at the same time and a rank that resumed while another started fresh would hang.
    ``expected``: the config keys the checkpoint must have been saved with (``checkpoint.compat``).
    No ``resume`` with checkpoints in ``run_dir`` is refused (a second run into it, e.g. a notebook cell run
    again), unless the process ``rejoins`` a running job (a replica group started again takes a peer's state).
    """
    from lit_titan.checkpoint import CheckpointError, latest_valid, published, set_aside, validate
    from lit_titan.checkpoint.compat import check_compatible
    from lit_titan.checkpoint.layout import CHECKSUMS, checkpoint_step

    own = run_dir / "checkpoints"
    if not resume:
        kept = published(own)
        # a fresh start would train again and then fail at its first save: say so before any work
        if kept and not rejoins:
            raise CheckpointError(
                f"run_dir {run_dir} already holds checkpoints (newest {kept[-1].name}) and resume is not set; "
                f"continue that run with resume=auto, or pass a new run_dir="
            )
        return None
    if str(resume) == "auto":
        ckpt, skipped = latest_valid(own, verify=True)
        for path, reason in skipped:
            _say(f"skipping damaged checkpoint: {reason}")
            if is_launcher_rank_zero():
                _say(f"moved it to {set_aside(path)} (kept for inspection; the run will save that step again)")
        _say(
            f"resume=auto: resuming from {ckpt}"
            if ckpt
            else f"resume=auto: no complete checkpoint in {run_dir / 'checkpoints'}; starting fresh"
        )
        if ckpt and not (ckpt / CHECKSUMS).is_file():
            _say(f"warning: {ckpt} has no {CHECKSUMS} (written by an earlier version): loaded unverified")
        if ckpt and expected:
            check_compatible(ckpt, expected)
        return str(ckpt) if ckpt else None
    path = Path(str(resume)).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(
            f"resume={resume} does not exist; point resume= at a checkpoint directory such as "
            f"<run_dir>/checkpoints/step-000100, or use resume=auto"
        )
    try:
        validate(path, verify=True)
    except CheckpointError as err:
        others = [p.name for p in published(path.parent) if p != path]
        hint = f" (other checkpoints there: {', '.join(others[-3:])})" if others else ""
        raise CheckpointError(
            f"resume={resume} cannot be used: {err}; choose an earlier checkpoint{hint} or resume=auto"
        ) from None
    newer = [p.name for p in published(own) if (checkpoint_step(p) or 0) > (checkpoint_step(path) or 0)]
    if newer:  # the resumed run would save those steps again: never overwrite a checkpoint
        raise CheckpointError(
            f"run_dir {run_dir} already holds checkpoints newer than resume={resume} "
            f"({', '.join(newer[-3:])}); resume from the newest with resume=auto, or pass a new "
            f"run_dir= to branch off from this checkpoint"
        )
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
    own = [
        o for o in hc.overrides.task if o.lstrip("+~").split("=", 1)[0] not in replaced and not o.startswith("hydra")
    ]
    config_dirs = [
        arg
        for source in hc.runtime.config_sources
        if source.provider == "command-line"
        for arg in ("--config-dir", str(source.path).removeprefix("file://"))
    ]  # the user's own groups
    own = redact(own, secrets_of(cfg, own))  # credentials as ***: the command is printed, into job logs
    more = [f"trainer.max_steps={2 * steps}", f"optim.total_steps={total}"] if more_steps else []
    return shlex.join(
        ["python", "-m", "lit_titan.train", *config_dirs, *own, f"run_dir={run_dir}", "resume=auto", *more]
    )


def archive_metrics(run_dir: Path) -> None:
    """Keep the metrics of an earlier attempt: Lightning's CSVLogger deletes metrics.csv on start."""
    metrics = run_dir / "metrics.csv"
    if is_launcher_rank_zero() and metrics.is_file():
        n = len(list(run_dir.glob("metrics.attempt-*.csv")))
        metrics.rename(run_dir / f"metrics.attempt-{n}.csv")


def _say(message: str) -> None:
    if is_launcher_rank_zero():
        print(f"lit-titan: {message}", file=sys.stderr, flush=True)
