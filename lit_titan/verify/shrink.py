"""The shrunk copy of a job that ``lit-titan verify`` trains twice: fewer layers, a short sequence, a small
global batch and a few steps, with the widths, the layout, the model family, the module, the optimizer and the
callbacks kept, so the parallel plan is the job's own.

Each shrunk value is the smallest the job's own config rules accept (``config.validate``: the layout must
still divide the heads, the sequence, the stages and the batch), so nothing here restates a divisibility rule.
The one-process reference is the same shrunk job with every parallel degree 1 and the whole global batch in
one forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.config import ConfigError, validate
from lit_titan.config.spec import JobSpec

__all__ = ["Shrunk", "shrink"]

# What a check run never does: save, validate, resume, start from weights whose shapes the shrunk model lacks,
# inject faults, or sit in a pre-flight burn-in.
CHECK_RUN = (
    "checkpoint.enabled=false",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "preflight.enabled=false",
    "resume=null",
    "fault_tolerance.enabled=false",
    "fault.kill_rank=null",
    "fault.slow_rank=null",
    "model.init_from_hf=null",
)
# The one-process reference: every degree 1 (dp_shard -1 over a world of one), the batch in one forward.
REFERENCE = (
    "cluster.devices=1",
    "cluster.num_nodes=1",
    "parallel.pp=1",
    "parallel.dp_replicate=1",
    "parallel.dp_shard=-1",
    "parallel.cp=1",
    "parallel.tp=1",
    "parallel.ep=1",
    "parallel.pp_stages=null",
    "parallel.pp_microbatches=null",
    "data.micro_batch_size=null",
)


@dataclass
class Shrunk:
    """The layout's and the reference's command lines, and what was shrunk (for the report)."""

    layout: list[str]
    reference: list[str]
    spec: JobSpec  # the shrunk layout's
    cfg: DictConfig  # the shrunk layout's config, what ``layout`` composes to
    notes: list[str] = field(default_factory=list)


def shrink(cfg: DictConfig, overrides: list[str], *, steps: int, precision: str, world_on_one_host: bool) -> Shrunk:
    """``overrides`` (the job's command line, composed into ``cfg``) turned into the two check runs.

    ``steps``: optimizer steps compared (the layout runs one more, for the known-norm check).
    ``world_on_one_host``: both sides run here, so a multi-node CPU layout becomes the same ranks on one node.
    """
    work = cfg.copy()
    chosen: dict[str, Any] = {}
    notes: list[str] = []

    def fix(key: str, value: Any) -> None:
        OmegaConf.update(work, key, value, force_add=True)
        chosen[key] = value

    for item in CHECK_RUN:
        key, value = item.split("=", 1)
        if OmegaConf.select(work, key, default="<absent>") != "<absent>":  # a family without the key
            fix(key, _yaml(value))
    fix("precision", precision)
    fix("trainer.max_steps", steps + 1)
    warmup = int(work.optim.get("warmup_steps", 0) or 0)
    if warmup > 1:
        fix("optim.warmup_steps", 1)  # the job's peak lr within the few steps compared
        notes.append(f"optim.warmup_steps {warmup} -> 1 (the peak lr within {steps} steps)")
    if world_on_one_host and int(work.cluster.num_nodes) > 1:
        world = int(work.cluster.num_nodes) * int(work.cluster.devices)
        if str(work.cluster.accelerator) != "cpu":
            raise ConfigError(
                f"cluster.num_nodes={work.cluster.num_nodes}: verify runs both sides on this machine; run it on the "
                "job's nodes under torchrun or srun (lit-titan launch --dry-run's command with -m lit_titan.cli.verify "
                f"for -m lit_titan.train), or here on CPU with cluster=cpu cluster.devices={world}"
            )
        fix("cluster.devices", world)
        fix("cluster.num_nodes", 1)
        notes.append(f"{world} ranks of {cfg.cluster.num_nodes} nodes run on this machine")
    spec = validate(work)  # the job itself, before anything is shrunk: its own error first

    args = spec.model
    layers = _smallest(work, "model.n_layers", range(1, args.n_layers + 1), lambda s, n: _keeps_layers(s, n, args))
    if layers is not None and layers != args.n_layers:
        fix("model.n_layers", layers)
        notes.append(f"model.n_layers {args.n_layers} -> {layers}")
    seq = spec.seq_len
    window = getattr(args, "sliding_window", None) or 0
    lengths = sorted({n for n in (2**k for k in range(4, 20)) if window < n <= seq} | {seq})
    shorter = _smallest(work, "data.seq_len", lengths)
    if shorter is not None and shorter != seq:
        fix("data.seq_len", shorter)
        notes.append(f"data.seq_len {seq} -> {shorter}")
    batch = spec.batch
    accumulation = min(batch.accumulation, 2)  # accumulation kept when the job accumulates
    for micro in range(min(2, batch.micro), batch.micro + 1):  # two sequences a forward where the job has them
        trial = work.copy()
        OmegaConf.update(trial, "data.micro_batch_size", micro)
        OmegaConf.update(trial, "data.global_batch_size", batch.dp * micro * accumulation)
        if _valid(trial):
            if batch.dp * micro * accumulation != batch.global_batch:
                notes.append(
                    f"data.global_batch_size {batch.global_batch} -> {batch.dp * micro * accumulation} "
                    f"(micro-batch {micro} per rank, {accumulation} per step)"
                )
            fix("data.micro_batch_size", micro)
            fix("data.global_batch_size", batch.dp * micro * accumulation)
            break
    spec = validate(work)
    layout = [*overrides, *(f"{k}={_show(v)}" for k, v in chosen.items())]
    return Shrunk(layout=layout, reference=[*layout, *REFERENCE], spec=spec, cfg=work, notes=notes)


def _keeps_layers(spec: JobSpec, n: int, full: Any) -> bool:
    """``n`` layers keep each kind of layer the job has: two at least (a layer's output feeds a layer), an MoE
    layer when the model has one, a global layer after the windowed ones."""
    if n < min(2, full.n_layers):
        return False
    is_moe = getattr(full, "is_moe", None)
    if is_moe is not None and any(is_moe(k) for k in range(full.n_layers)) and not any(is_moe(k) for k in range(n)):
        return False
    pattern = getattr(full, "window_pattern", None)
    return not (pattern and full.n_layers >= pattern and n < pattern)


def _smallest(cfg: DictConfig, key: str, values, keep=None) -> Any:
    """The first of ``values`` the job's rules accept for ``key`` (and ``keep`` agrees with), else None."""
    for value in values:
        trial = cfg.copy()
        OmegaConf.update(trial, key, value)
        spec = _valid(trial)
        if spec is not None and (keep is None or keep(spec, value)):
            return value
    return None


def _valid(cfg: DictConfig) -> JobSpec | None:
    try:
        return validate(cfg, schema_checked=True)
    except ValueError:
        return None


def _yaml(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
