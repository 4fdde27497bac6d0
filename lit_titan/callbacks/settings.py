"""The callbacks' settings: each callback's argument and its config node in one declaration.

``conf/callbacks/<name>.yaml`` nodes (a ``_target_`` and these fields) are checked against the class
of the same ``_target_`` (``TARGETS``, which the schema's ``TARGET_SCHEMAS`` takes); the top-level groups
``checkpoint``, ``nonfinite``, ``fault`` and ``preflight`` (``conf/train.yaml``) are the settings of the
callbacks ``job/build.py`` adds itself. A callback takes its dataclass, or its fields one by one
(``Compile(backend="eager")``, Hydra's instantiation): ``lit_titan.settings.settings_of``.

Free of torch on purpose: the config schema and ``--help`` import it before anything heavy is loaded.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from lit_titan.settings import non_empty_str, path_or_null, setting
from lit_titan.strategies.parallel_dims import MESH_DIMS
from lit_titan.strategies.settings import AC_MODES, FLOAT8_RECIPES

# A hung rank's exit code (Watchdog): EX_TEMPFAIL, non-zero so a launcher restarts the job.
WATCHDOG_EXIT_CODE = 75
# nonfinite.action: stop (raise before the update) | skip_step (drop the update)
NONFINITE_ACTIONS = ("stop", "skip_step")
# preflight.action: warn (train anyway) | stop (end the job before anything is built)
PREFLIGHT_ACTIONS = ("warn", "stop")
# fault.slow_link: a node's own links (the ranks of its node, the same local rank on every node) or a mesh dim
NODE_LINKS = ("intra_node", "inter_node")
SLOW_LINKS = (*NODE_LINKS, *MESH_DIMS)


def _profile_steps(value: list[int]) -> str | None:
    return None if all(s >= 1 for s in value) else "steps count from 1; use e.g. [3, 4]"


def _errno_name(value: Any) -> str | None:
    return (
        None if isinstance(value, str) and hasattr(errno, value) else "not an errno name; use e.g. ENOSPC, EACCES, EIO"
    )


# ---- conf/callbacks/ (a _target_ node each) ----------------------------------------------------------
@dataclass
class ActivationCheckpointingConfig:
    _target_: str = setting("lit_titan.callbacks.ActivationCheckpointing")  # Hydra's
    mode: str = setting("selective_op", choices=AC_MODES)
    every_n_layers: int = setting(2, ge=1)  # selective_layer: checkpoint every N-th block


@dataclass
class CompileConfig:
    _target_: str = setting("lit_titan.callbacks.Compile")
    fullgraph: bool = setting(True)
    backend: str = setting("inductor", check=non_empty_str)
    mode: str | None = setting(None, check=non_empty_str)
    compile_loss: bool = setting(False)  # also compile the module's compute_loss


@dataclass
class Float8Config:
    _target_: str = setting("lit_titan.callbacks.Float8")
    recipe: str = setting("tensorwise", choices=FLOAT8_RECIPES)
    enable_fsdp_float8_all_gather: bool = setting(True)  # tensorwise only
    precompute_scales: bool = setting(True)
    emulate: bool = setting(False)  # the numerics without FP8 units (CPU included)
    filter_fqns: list[str] = setting(lambda: ["output"])
    min_dim: int = setting(16, ge=1)
    auto_filter_small_kn: bool = setting(True)
    float8_tp: bool = setting(False)  # tensorwise only: TP all-gathers in float8


@dataclass
class ProfilerConfig:
    _target_: str = setting("lit_titan.callbacks.Profiler")
    steps: list[int] | None = setting(None, check=_profile_steps)
    every_n_steps: int | None = setting(None, ge=1)
    active: int = setting(2, ge=1)
    warmup: int = setting(1, ge=0)
    record_shapes: bool = setting(False)
    with_stack: bool = setting(False)
    profile_memory: bool = setting(False)
    memory_snapshot: bool = setting(True)
    oom_snapshot: bool = setting(True)
    run_dir: str | None = setting(None, check=path_or_null)


@dataclass
class ReplicaCheckConfig:
    _target_: str = setting("lit_titan.callbacks.ReplicaDivergenceCheck")
    every_n_steps: int = setting(1000, ge=1)
    action: str = setting("raise", choices=("raise", "record"))


@dataclass
class StragglerConfig:
    _target_: str = setting("lit_titan.callbacks.StragglerReport")
    every_n_steps: int = setting(100, ge=1)
    warn_ratio: float = setting(1.2, gt=1)


@dataclass
class ThroughputConfig:
    _target_: str = setting("lit_titan.callbacks.ThroughputMonitor")
    warmup_steps: int = setting(1, ge=1)  # the first step has no previous step end to time from
    log_memory: bool = setting(True)
    peak_tflops: float | None = setting(None, gt=0)  # None: the peak table's, by device name


@dataclass
class TimelineConfig:
    _target_: str = setting("lit_titan.callbacks.Timeline")
    run_dir: str | None = setting(None, check=path_or_null)


@dataclass
class WatchdogConfig:
    _target_: str = setting("lit_titan.callbacks.Watchdog")
    timeout_s: float = setting(600.0, gt=0)
    first_step_timeout_s: float | None = setting(None, gt=0)  # None: timeout_s
    run_dir: str | None = setting(None, check=path_or_null)
    exit_code: int = setting(WATCHDOG_EXIT_CODE, ge=1, le=255)
    exit_delay_s: float = setting(10.0, ge=0)
    backstop_s: float | None = setting(60.0, ge=0)  # None: no backstop


TARGETS: dict[str, type] = {
    c._target_: c
    for c in (
        ActivationCheckpointingConfig,
        CompileConfig,
        Float8Config,
        ProfilerConfig,
        ReplicaCheckConfig,
        StragglerConfig,
        ThroughputConfig,
        TimelineConfig,
        WatchdogConfig,
    )
}


# ---- groups of conf/train.yaml: the callbacks job/build.py adds --------------------------------------
@dataclass
class CheckpointConfig:  # Checkpointing
    enabled: bool = setting(True)  # read by job/build.py: whether the callback is added at all
    every_n_steps: int = setting(0, ge=0)  # 0: only at the end of training
    keep_last: int = setting(3, ge=0)  # 0: keep all
    async_save: bool = setting(True)


@dataclass
class NonFiniteConfig:  # NonFiniteGuard
    enabled: bool = setting(True)
    action: str = setting("stop", choices=NONFINITE_ACTIONS)
    max_consecutive_skips: int = setting(5, ge=1)


@dataclass
class FaultConfig:  # FaultInjection (kill_rank .. pause) and Preflight's drill (slow_*)
    kill_rank: int | None = setting(None, ge=0)  # None: no fault injected
    at_step: int | None = setting(None, ge=1)
    during_save: bool = setting(False)
    save_error: str | None = setting(None, check=_errno_name)
    stage_error: str | None = setting(None, check=_errno_name)
    pause: bool = setting(False)
    slow_rank: int | None = setting(None, ge=0)
    slow_factor: float = setting(4.0, gt=0)
    slow_link: str | None = setting(None, choices=SLOW_LINKS)


@dataclass
class PreflightConfig:  # Preflight (lit_titan/observe/diagnostics.py)
    enabled: bool = setting(False)
    action: str = setting("warn", choices=PREFLIGHT_ACTIONS)
    threshold: float = setting(0.5, gt=0, le=1)  # a fraction of the median
    only: bool = setting(False)  # run the diagnostics and end the job (lit-titan preflight)
