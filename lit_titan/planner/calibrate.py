"""``lit-titan plan calibrate=RUN_DIR[,RUN_DIR...]``: fit the step-time model's efficiencies to measured runs.

Each run directory holds ``config.yaml`` (its layout, model, batch and cluster profile),
``metrics.csv`` (``perf/tokens_per_sec_per_device`` per logged step) and, when the run had the
timeline callback, ``timeline/rank-0.csv`` (per-step wall time and phases). The fit:

- ``overhead_s``: the median per-step time outside forward/backward/pipeline (data, optimizer,
  gradient clipping, Lightning's loop), from the timeline; 0 without one;
- ``compute`` (fraction of ``peak``) and, with two runs or more, ``comm`` (fraction of link bandwidth):
  a grid over both minimising the squared log error of the predicted against the measured step time
  (median over steps after the first two, which carry start-up and compile). One run cannot separate
  the two, so ``comm`` keeps its default there (the file says so).

The result is written as YAML (``calibration.yaml`` in the first run directory unless ``out`` names a
file) and read back by ``plan.calibration=FILE`` (:func:`load_calibration`).
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lit_titan.errors import ConfigError
from lit_titan.planner import estimate
from lit_titan.planner.estimate import Efficiencies
from lit_titan.planner.optimizer_state import optimizer_states

SKIP_STEPS = 2  # first steps: process start-up, allocator warm-up, compilation


def load_calibration(path: str | Path) -> Efficiencies:
    """Efficiencies from a calibration file: a path, or the name of one shipped in
    lit_titan/planner/calibrations/ (not under conf/: Hydra would take it for a config group)."""
    p = Path(path)
    shipped = Path(__file__).parent / "calibrations" / f"{path}.yaml"
    if not p.is_file() and shipped.is_file():
        p = shipped
    if not p.is_file():
        raise ConfigError(f"plan.calibration={path}: no such file; write one with lit-titan plan calibrate=RUN_DIR")
    data = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    eff = data.get("efficiencies") if isinstance(data, dict) else None
    if not isinstance(eff, dict):
        raise ConfigError(
            f"plan.calibration={path} has no 'efficiencies' mapping; regenerate it with "
            f"lit-titan plan calibrate=RUN_DIR"
        )
    known = set(Efficiencies.__dataclass_fields__)
    return Efficiencies(**{k: v for k, v in eff.items() if k in known})


def measured(run_dir: str | Path) -> dict[str, Any]:
    """Median step wall time and phase split of a run (timeline), else from tokens/s in metrics.csv."""
    d = Path(run_dir)
    if not (d / "config.yaml").is_file():
        raise ConfigError(f"calibrate={run_dir}: no config.yaml there; point calibrate= at a training run_dir")
    cfg = OmegaConf.load(d / "config.yaml")
    out: dict[str, Any] = {"run_dir": str(d), "cfg": cfg}
    timeline = d / "timeline" / "rank-0.csv"
    if timeline.is_file():
        with timeline.open() as f:
            rows = list(csv.DictReader(f))[SKIP_STEPS:]
        if rows:
            f = lambda k: statistics.median(float(r[k]) for r in rows)  # noqa: E731
            busy = statistics.median(
                float(r["forward_s"]) + float(r["backward_s"]) + float(r["pipeline_s"]) for r in rows
            )
            out.update(
                step_s=f("wall_s"),
                busy_s=busy,
                overhead_s=max(f("wall_s") - busy, 0.0),
                steps=len(rows),
                source="timeline/rank-0.csv",
            )
            return out
    metrics = d / "metrics.csv"
    if not metrics.is_file():
        raise ConfigError(
            f"calibrate={run_dir}: neither timeline/rank-0.csv nor metrics.csv; run training with "
            f"callbacks including throughput or timeline"
        )
    tps = [
        float(r["perf/tokens_per_sec_per_device"])
        for r in csv.DictReader(metrics.open())
        if r.get("perf/tokens_per_sec_per_device")
    ][SKIP_STEPS:]
    if not tps:
        raise ConfigError(
            f"calibrate={run_dir}: metrics.csv has no perf/tokens_per_sec_per_device after step "
            f"{SKIP_STEPS}; run more steps with the throughput callback"
        )
    from lit_titan.config.spec import world_size

    tokens = int(cfg.data.global_batch_size) * int(cfg.data.seq_len)
    out.update(
        step_s=tokens / world_size(cfg) / statistics.median(tps),
        busy_s=None,
        overhead_s=0.0,
        steps=len(tps),
        source="metrics.csv",
    )
    return out


def _setup(cfg) -> dict[str, Any]:
    """The layout a run's (or plan's) config describes, in closed form (no meta-model build)."""
    from lit_titan.config.spec import batch_layout, model_args, parallel_dims, pipeline_config
    from lit_titan.models.registry import count_params, flops_per_token
    from lit_titan.planner.analytic import analytic_layout

    args, dims = model_args(cfg), parallel_dims(cfg)
    seq_len, gb, precision = int(cfg.data.seq_len), int(cfg.data.global_batch_size), str(cfg.precision)
    cbs = cfg.get("callbacks") or {}
    ac = next(
        (
            str(n.get("mode", "none"))
            for n in cbs.values()
            if str(n.get("_target_", "")).endswith("ActivationCheckpointing")
        ),
        "none",
    )
    f8 = any(str(n.get("_target_", "")).endswith(".Float8") for n in cbs.values())
    pcfg = pipeline_config(cfg) if dims.pp > 1 else None
    batch = batch_layout(cfg, dims, check=False)
    local = batch.micro
    m = pcfg.microbatches_for(dims.pp) if pcfg else 1
    return dict(
        args=args,
        dims=dims,
        seq_len=seq_len,
        gb=gb,
        accumulation=batch.accumulation,
        precision=precision,
        ac=ac,
        f8=f8,
        local=local,
        m=m,
        v=pcfg.per_rank if pcfg else 1,
        fpt=flops_per_token(args, seq_len, count_params(args)),
        layout=analytic_layout(args, dims, pcfg, precision=precision, ac_mode=ac),
        cluster=OmegaConf.to_container(cfg.cluster, resolve=True),
        reshard=bool(cfg.parallel.reshard_after_forward),
        grs=str(cfg.parallel.get("grad_reduce_scatter", "every_microbatch")),
        cp_mode=str(cfg.parallel.get("cp_mode", "allgather")),
        optim=optimizer_states(cfg),
    )


def predict(cfg, eff: Efficiencies) -> dict[str, Any]:
    """Predicted step of the layout a run's config describes."""
    return _predict(_setup(cfg), eff)


def _predict(s: dict[str, Any], eff: Efficiencies) -> dict[str, Any]:
    """``predict`` on a layout already worked out (the fit's grid reuses it for every point)."""
    cluster = s["cluster"]
    return estimate.step_time(
        s["args"],
        s["dims"],
        cluster,
        s["layout"],
        flops_per_token=s["fpt"],
        seq_len=s["seq_len"],
        global_batch=s["gb"],
        micro_batch=s["local"],
        pp_microbatches=s["m"],
        stages_per_rank=s["v"],
        ac_mode=s["ac"],
        reshard_after_forward=s["reshard"],
        precision=s["precision"],
        grad_reduce_scatter=s["grs"],
        optimizer="for_loop" if cluster.get("accelerator") == "cpu" else "fused",
        float8=s["f8"],
        eff=eff,
        cp_mode=s["cp_mode"],
        optimizer_states=s["optim"],
    )


def predict_memory(cfg) -> int:
    """Estimated bytes on the most loaded rank (estimate.rank_memory, as the plan and the search)."""
    s = _setup(cfg)
    dims = s["dims"]
    micro = max(s["local"] // s["m"], 1) if dims.pp > 1 else s["local"]
    return estimate.rank_memory(
        s["args"],
        dims,
        s["layout"],
        precision=s["precision"],
        seq_len=s["seq_len"],
        micro_batch=micro,
        pp_microbatches=s["m"],
        stages_per_rank=s["v"],
        accumulation=s["accumulation"],
        reshard_after_forward=s["reshard"],
        grad_reduce_scatter=s["grs"],
        loss_chunk_tokens=_loss_chunk(cfg, s["args"]),
        document_masking=bool((cfg.get("data") or {}).get("document_masking", False)),
        cp_mode=s["cp_mode"],
        optimizer_states=optimizer_states(cfg),
    )["max_total_bytes"]


def _loss_chunk(cfg, args) -> int:
    from lit_titan.job.settings import LossConfig
    from lit_titan.models.loss import resolve_chunk_tokens

    return resolve_chunk_tokens((cfg.get("loss") or {}).get("chunk_tokens", LossConfig().chunk_tokens), args.vocab_size)


def fit(runs: list[dict[str, Any]], base: Efficiencies = estimate.DEFAULT_EFFICIENCIES) -> Efficiencies:
    """Grid fit of compute (and comm, with >= 2 runs) efficiencies to the runs' median step times."""
    overhead = statistics.median(r["overhead_s"] for r in runs)
    grid = [10 ** (-4 + 4 * k / 160) for k in range(161)]  # 1e-4 .. 1, log-spaced
    comms = grid if len(runs) > 1 else [base.comm]
    setups = [_setup(r["cfg"]) for r in runs]  # once per run, not once per grid point

    def loss(c: float, m: float) -> float:
        eff = base.with_(compute=c, comm=m, overhead_s=overhead)
        return sum(math.log(_predict(setup, eff)["step_s"] / r["step_s"]) ** 2 for setup, r in zip(setups, runs))

    best = min(((c, m) for c in grid for m in comms), key=lambda cm: loss(*cm))
    names = ", ".join(Path(r["run_dir"]).name for r in runs)
    return base.with_(
        compute=best[0],
        comm=best[1],
        overhead_s=overhead,
        source=f"calibrated on {names}" + ("" if len(runs) > 1 else " (comm: default, one run)"),
    )


def calibrate_run(run_dirs: str, out: str | None = None) -> dict[str, Any]:
    """Fit and write the calibration file; returns {'efficiencies', 'path', 'runs'}."""
    dirs = [d for d in str(run_dirs).split(",") if d]
    runs = [measured(d) for d in dirs]
    eff = fit(runs)
    path = Path(out) if out else Path(dirs[0]) / "calibration.yaml"
    report = [
        {
            "run_dir": r["run_dir"],
            "measured_step_s": r["step_s"],
            "source": r["source"],
            "predicted_step_s": predict(r["cfg"], eff)["step_s"],
        }
        for r in runs
    ]
    doc = {"efficiencies": eff.as_dict(), "runs": report}
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(doc)))
    return {"efficiencies": eff.as_dict(), "path": str(path), "runs": report}
