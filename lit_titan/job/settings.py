"""The ``trainer``, ``cluster`` and ``loss`` groups: what ``job/build.py`` hands to Lightning's ``Trainer``
(and the strategy, the launchers, the planner) and to ``PretrainModule``, declared once.

``TrainerConfig``'s fields are ``lightning.Trainer`` arguments by the same names, passed on as they are
(``job.build.trainer_arguments``); ``ClusterConfig`` holds the Trainer's ``accelerator``/``devices``/
``num_nodes``/``precision`` plus the facts the planner and the launchers read from a cluster profile
(``conf/cluster/*.yaml``). Free of torch on purpose: the config schema imports it before anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_titan.settings import non_empty_str, setting

# 64-true: float64 end to end on CPU, for parity checks (tolerances ~1e-10 instead of ~1e-5), not for training speed
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "64-true")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LAUNCHERS = ("torchrun", "srun")  # how `lit-titan launch` starts a job (cli/launch.py)


def _number_or_fraction(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return "not a count or a fraction; use an int >= 0 (that many) or a float in [0, 1] (that fraction)"
    if isinstance(value, float) and value > 1:
        return "a float is a fraction; use one in [0, 1], or an int for a count"
    return None


def _positive_number_or_fraction(value: Any) -> str | None:
    problem = _number_or_fraction(value)
    return problem or ("zero; use an int >= 1 or a fraction in (0, 1]" if value == 0 else None)


def _chunk_tokens(value: Any) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    return "not auto or a token count; use auto, 0 (off) or a positive number of tokens"


@dataclass
class LossConfig:
    """The loss head (``PretrainModule``'s ``loss_chunk_tokens``, ``models/loss.py``): cross-entropy per chunk
    of ``chunk_tokens`` tokens; auto: 1024 when the vocabulary has >= 32K entries, else off; 0: off."""

    chunk_tokens: Any = setting("auto", check=_chunk_tokens)


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` arguments, by their Trainer names (``val_check_interval`` applies only when
    ``limit_val_batches`` runs validation at all)."""

    max_steps: int = setting(100, ge=1)
    gradient_clip_val: float | None = setting(1.0, ge=0)
    log_every_n_steps: int = setting(1, ge=1)
    limit_val_batches: Any = setting(0, check=_number_or_fraction)
    val_check_interval: Any = setting(50, check=_positive_number_or_fraction)
    enable_progress_bar: bool = setting(True)
    deterministic: bool = setting(False)


@dataclass
class ClusterConfig:
    """A cluster profile: the Trainer's devices and precision, the collective timeout, and the facts the
    planner (peaks, bandwidths, memory) and the launchers (Slurm keys) read."""

    accelerator: str = setting("cpu", choices=ACCELERATORS)
    devices: int = setting(1, ge=1)  # processes per node
    num_nodes: int = setting(1, ge=1)
    launcher: str = setting("torchrun", choices=LAUNCHERS)
    precision: str = setting("32-true", choices=PRECISIONS)
    gpus_per_node: int | None = setting(None, ge=1)
    hbm_gib: float | None = setting(None, gt=0)
    hbm_gbps: float | None = setting(None, gt=0)
    peak_bf16_tflops: float | None = setting(None, gt=0)
    peak_fp32_tflops: float | None = setting(None, gt=0)
    fp8: bool | None = setting(None)
    intra_node_gbps: float | None = setting(None, gt=0)
    inter_node_gbps: float | None = setting(None, gt=0)
    cores_per_node: int | None = setting(None, ge=1)
    timeout_s: int = setting(1800, ge=1)  # collective timeout
    log_every_n_steps: int = setting(1, ge=1)  # trainer.log_every_n_steps's default
    data_workers: int = setting(0, ge=0)  # data.num_workers's default
    flight_recorder_entries: int = setting(0, ge=0)  # 0: torch's default
    # launches (lit-titan launch, hydra/launcher=submitit_*): no yaml of ours sets them
    max_restarts: int | None = setting(None, ge=0)
    partition: str | None = setting(None, check=non_empty_str)
    account: str | None = setting(None, check=non_empty_str)
    qos: str | None = setting(None, check=non_empty_str)
    constraint: str | None = setting(None, check=non_empty_str)
    time_min: int | None = setting(None, ge=1)
    cpus_per_task: int | None = setting(None, ge=1)
    mem_gb: float | None = setting(None, gt=0)
    sbatch: dict[str, Any] | None = setting(None)
    setup: list[str] | None = setting(None)
