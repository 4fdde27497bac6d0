"""``lit-titan plan search=true``: every valid layout for a model and cluster, ranked by predicted throughput.

Analytic: each candidate's rank-0 layout comes from :func:`lit_titan.planner.analytic.analytic_layout`
and its memory and step time from the same :mod:`lit_titan.planner.estimate` functions the one-layout
plan uses; only the top few are then built for real (meta model over a fake process group) to
confirm their per-rank parameter memory and that ``TitanStrategy.parallelize`` accepts them.

Enumerated: pp x dp_replicate x dp_shard x cp x tp = world, with tp dividing the heads and kv heads
and at most one node (its collectives are exposed on every block: across nodes they never win),
seq_len divisible by tp (x 2cp), the global batch by dp; pipeline schedules 1F1B and Interleaved1F1B
(2 stages per rank; GPipe holds more activations for the same bubble, the zero-bubble schedules give
wrong gradients with FSDP2 resharding after forward); micro-batch sizes dividing the local batch (under PP:
pipeline micro-batches, at least pp of them and, interleaved, a multiple of pp); activation
checkpointing none/selective_op/full; gradient reduce-scatter every/last micro-batch when
accumulating; Float8 on profiles whose GPUs have FP8 units (``cluster.fp8: true``); with cp > 1 every
``parallel.cp_mode`` the model allows (ulysses: heads and KV heads divisible by tp x cp; planner/cp_modes.py),
shown as ``cp2`` (allgather), ``cp2u`` (ulysses), ``cp2r`` (ring). For an MoE model also
expert parallel: ``ep`` dividing dp_shard x cp and the number of experts, where the config's rules accept
it with the layout's tp and activation checkpointing (``config/rules.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.data.batch_layout import BatchLayout
from lit_titan.errors import ConfigError
from lit_titan.planner import cp_modes, estimate
from lit_titan.planner.analytic import analytic_layout
from lit_titan.planner.estimate import GIB, HBM_RESERVE_GIB
from lit_titan.planner.optimizer_state import OptimizerStates, optimizer_states
from lit_titan.strategies.parallel_dims import ParallelDims
from lit_titan.strategies.pipeline import PipelineConfig

AC_MODES = ("none", "selective_op", "full")
SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))
# step-time terms compared to say why the runner-up lost (plan key, words)
TERMS = (
    ("compute_s", "compute"),
    ("exposed_fsdp_s", "exposed FSDP communication"),
    ("tp_comm_s", "TP communication"),
    ("cp_comm_s", "CP communication"),
    ("ep_comm_s", "expert-parallel all-to-all"),
    ("bubble_s", "pipeline bubble"),
    ("hsdp_comm_s", "HSDP all-reduce"),
    ("optimizer_s", "optimizer step"),
    ("muon_s", "Muon's gather and Newton-Schulz"),
)


@dataclass
class Candidate:
    dims: ParallelDims
    schedule: str | None  # None: no pipeline
    stages_per_rank: int
    micro_batch: int  # sequences per forward (per pipeline micro-batch under PP)
    local_batch: int  # sequences per dp rank per step
    accumulation: int  # Lightning micro-batches per step (1 under PP)
    pp_microbatches: int
    ac_mode: str
    float8: bool
    grad_reduce_scatter: str
    memory: dict[str, Any] = field(default_factory=dict)
    perf: dict[str, Any] = field(default_factory=dict)
    confirmed: dict[str, Any] | None = None
    cp_mode: str = "allgather"  # parallel.cp_mode (planner/cp_modes.py); only cp > 1 tries the others
    moe: bool = False  # an MoE model: the layout names parallel.ep (1 included)

    @property
    def tokens_per_sec(self) -> float:
        return self.perf.get("tokens_per_sec_per_device", 0.0)

    def describe(self) -> str:
        d = self.dims
        mesh = f"pp{d.pp} dpr{d.dp_replicate} dps{d.dp_shard} cp{d.cp}{self._cp_suffix()} tp{d.tp}" + (
            f" ep{d.ep}" if self.moe else ""
        )
        pipe = f" {self.schedule} m{self.pp_microbatches}" if self.schedule else f" accum{self.accumulation}"
        return f"{mesh}{pipe} mb{self.micro_batch} ac={self.ac_mode}{' fp8' if self.float8 else ''}"

    def _cp_suffix(self) -> str:
        return {"allgather": "", "ulysses": "u", "ring": "r"}[self.cp_mode] if self.dims.cp > 1 else ""

    def overrides(self, callbacks: list[str]) -> list[str]:
        """Hydra overrides that select this layout on top of the user's own (``callbacks``: theirs)."""
        d = self.dims
        out = [f"parallel.{k}={v}" for k, v in d.as_dict().items()]
        if d.cp > 1:
            out.append(f"parallel.cp_mode={self.cp_mode}")
        if self.moe:
            out.append(f"parallel.ep={d.ep}")
        if self.schedule:
            out += [
                f"parallel.pp_schedule={self.schedule}",
                f"parallel.pp_stages_per_rank={self.stages_per_rank}",
                f"parallel.pp_microbatches={self.pp_microbatches}",
                f"data.micro_batch_size={self.local_batch}",
            ]
        else:
            out += [f"data.micro_batch_size={self.micro_batch}"]
            if self.grad_reduce_scatter != "every_microbatch":
                out.append(f"parallel.grad_reduce_scatter={self.grad_reduce_scatter}")
        cbs = [c for c in callbacks if c not in ("activation_checkpointing", "float8")]
        if self.ac_mode != "none":
            cbs.append("activation_checkpointing")
        if self.float8:
            cbs.append("float8")
        out.append(f"callbacks=[{','.join(cbs)}]")
        if self.ac_mode != "none":
            out.append(f"callbacks.activation_checkpointing.mode={self.ac_mode}")
        return out


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(
    args, *, world: int, seq_len: int, global_batch: int, gpus_per_node: int, fp8: bool
) -> list[Candidate]:
    """Every candidate whose degrees divide the world and the model and that the model family's parallel
    plan covers (no pipeline or context parallel where it has none; no memory or time yet)."""
    from lit_titan.models.registry import num_experts, spec_of

    plan = spec_of(args).plan
    experts = num_experts(args)
    out: list[Candidate] = []
    n_units = args.n_layers + 2
    # the pooled MoE auxiliary loss has no per-stage share (config/rules.py: moe_aux_loss_fits_pp)
    moe = getattr(args, "moe", None)
    no_pp = plan.pipeline_units is None or (moe is not None and moe.aux_loss == "pooled" and moe.aux_loss_coef > 0)
    for tp in divisors(world):
        if tp > max(gpus_per_node, 1) or args.n_heads % tp or args.kv_heads % tp or seq_len % tp:
            continue
        for cp in divisors(world // tp):
            if cp > 1 and (seq_len % (2 * cp * tp) or plan.attention_cores is None):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > n_units or (pp > 1 and no_pp):
                    continue
                for dpr in divisors(world // (tp * cp * pp)):
                    dps = world // (tp * cp * pp * dpr)
                    dims = ParallelDims(pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, world_size=world)
                    if global_batch % dims.dp:
                        continue
                    local = global_batch // dims.dp
                    for ep in [e for e in divisors(dps * cp) if experts % e == 0] if experts else [1]:
                        dims_ep = replace(dims, ep=ep)
                        for mode in cp_modes.modes_for(args, tp, cp):
                            for c in _batch_options(dims_ep, local, n_units, fp8):
                                c.moe = bool(experts)
                                c.cp_mode = mode
                                if not (ep > 1 and _refused(args, dims_ep, c.ac_mode)):
                                    out.append(c)
    return out


def _refused(args, dims: ParallelDims, ac_mode: str) -> str | None:
    """The config rules on expert parallel (with tp, with activation checkpointing) for one candidate:
    the search proposes only what training would accept."""
    from lit_titan.config import rules

    cfg = OmegaConf.create({"callbacks": {"activation_checkpointing": {"mode": ac_mode}} if ac_mode != "none" else {}})
    for rule in (
        rules.experts_fit_ep,
        rules.expert_parallel_with_selective_op_checkpointing,
    ):
        try:
            rule(cfg, args, dims)
        except ValueError as err:
            return str(err)
    return None


def _batch_options(dims: ParallelDims, local: int, n_units: int, fp8: bool) -> list[Candidate]:
    out = []
    f8s = (False, True) if fp8 else (False,)
    for mb in divisors(local):
        if dims.pp > 1:
            m = local // mb
            for schedule, v in SCHEDULES:
                if n_units < dims.pp * v or m < dims.pp or (v > 1 and m % dims.pp):
                    continue
                for ac in AC_MODES:
                    for f8 in f8s:
                        out.append(Candidate(dims, schedule, v, mb, local, 1, m, ac, f8, "every_microbatch"))
        else:
            accum = BatchLayout.derive(local * dims.dp, mb, dims.dp).accumulation
            for grs in ("every_microbatch", "last_microbatch") if accum > 1 else ("every_microbatch",):
                for ac in AC_MODES:
                    for f8 in f8s:
                        out.append(Candidate(dims, None, 1, mb, local, accum, 1, ac, f8, grs))
    return out


def evaluate(
    cands: list[Candidate],
    args,
    cluster: dict[str, Any],
    *,
    precision: str,
    seq_len: int,
    global_batch: int,
    flops_per_token: float,
    eff: estimate.Efficiencies,
    optimizer: str,
    reshard_after_forward: bool = True,
    loss_chunk_tokens: int = 0,
    optimizer_states: OptimizerStates | None = None,
) -> None:
    """Fill each candidate's memory and (when it fits) predicted step; layouts are built once per mesh."""
    layouts: dict[tuple, Any] = {}
    capacity = _capacity(cluster)
    for c in cands:
        key = (c.dims, c.schedule, c.stages_per_rank)
        if key not in layouts:
            pcfg = PipelineConfig(schedule=c.schedule, stages_per_rank=c.stages_per_rank) if c.schedule else None
            layouts[key] = analytic_layout(args, c.dims, pcfg, precision=precision)
        layout = replace(layouts[key], ac_mode=c.ac_mode, float8_layers=int(c.float8))
        c.memory = estimate.rank_memory(
            args,
            c.dims,
            layout,
            precision=precision,
            seq_len=seq_len,
            micro_batch=c.micro_batch,
            pp_microbatches=c.pp_microbatches,
            stages_per_rank=c.stages_per_rank,
            accumulation=c.accumulation,
            reshard_after_forward=reshard_after_forward,
            grad_reduce_scatter=c.grad_reduce_scatter,
            loss_chunk_tokens=loss_chunk_tokens,
            cp_mode=c.cp_mode,
            optimizer_states=optimizer_states,
        )
        if capacity is not None and c.memory["max_total_bytes"] > capacity:
            continue
        c.perf = estimate.step_time(
            args,
            c.dims,
            cluster,
            layout,
            flops_per_token=flops_per_token,
            seq_len=seq_len,
            global_batch=global_batch,
            micro_batch=c.micro_batch if not c.schedule else c.local_batch,
            pp_microbatches=c.pp_microbatches,
            stages_per_rank=c.stages_per_rank,
            ac_mode=c.ac_mode,
            reshard_after_forward=reshard_after_forward,
            precision=precision,
            grad_reduce_scatter=c.grad_reduce_scatter,
            optimizer=optimizer,
            float8=c.float8,
            eff=eff,
            cp_mode=c.cp_mode,
            optimizer_states=optimizer_states,
        )


def _capacity(cluster: dict[str, Any]) -> float | None:
    return (float(cluster["hbm_gib"]) - HBM_RESERVE_GIB) * GIB if cluster.get("hbm_gib") else None


def search(
    cfg: DictConfig, overrides: list[str], *, eff: estimate.Efficiencies | None = None, top: int = 10, confirm: int = 3
) -> dict[str, Any]:
    """Rank every valid layout of ``cfg``'s model on its cluster; raise ConfigError when none fits."""
    from lit_titan.config.spec import model_args, world_size
    from lit_titan.models.registry import count_params, flops_per_token
    from lit_titan.planner.core import _optimizer_implementation

    t0 = time.perf_counter()
    eff = eff or estimate.DEFAULT_EFFICIENCIES
    args = model_args(cfg)
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    if not cluster.get("hbm_gib"):
        raise ConfigError(
            "plan search needs the GPU memory: the cluster profile has no hbm_gib; add "
            "+cluster.hbm_gib=N (GiB per device) or pick a profile such as cluster=h100_8"
        )
    world, seq_len = world_size(cfg), int(cfg.data.seq_len)
    global_batch, precision = int(cfg.data.global_batch_size), str(cfg.precision)
    fpt = flops_per_token(args, seq_len, num_params=count_params(args))
    probe = analytic_layout(args, ParallelDims(world_size=1, dp_shard=1), None, precision=precision)
    optimizer = _optimizer_implementation(cfg, cluster, probe)
    cands = enumerate_layouts(
        args,
        world=world,
        seq_len=seq_len,
        global_batch=global_batch,
        gpus_per_node=int(cluster.get("gpus_per_node") or cluster.get("devices") or 1),
        fp8=bool(cluster.get("fp8")),
    )
    from lit_titan.job.settings import LossConfig
    from lit_titan.models.loss import resolve_chunk_tokens

    loss_chunk = resolve_chunk_tokens(
        (cfg.get("loss") or {}).get("chunk_tokens", LossConfig().chunk_tokens), args.vocab_size
    )
    evaluate(
        cands,
        args,
        cluster,
        precision=precision,
        seq_len=seq_len,
        global_batch=global_batch,
        flops_per_token=fpt,
        eff=eff,
        optimizer=optimizer,
        loss_chunk_tokens=loss_chunk,
        optimizer_states=optimizer_states(cfg),
    )
    fitting = sorted(
        (c for c in cands if c.perf), key=lambda c: (-c.tokens_per_sec, c.float8, c.memory["max_total_bytes"])
    )
    callbacks = list((cfg.get("callbacks") or {}).keys())
    if not fitting:
        raise ConfigError(no_fit_message(cfg, cands, cluster, world))
    result: dict[str, Any] = {
        "model": str(cfg.model.name),
        "world_size": world,
        "candidates": len(cands),
        "fitting": len(fitting),
        "efficiencies": eff.as_dict(),
        "hbm_gib": cluster["hbm_gib"],
        "reserve_gib": HBM_RESERVE_GIB,
        "search_seconds": round(time.perf_counter() - t0, 2),
    }
    confirmed = _confirm(fitting, overrides, callbacks, eff, confirm)
    ranked = [c for c in fitting if c.confirmed is None or c.confirmed["fits"]]
    result["top"] = [row(c, callbacks) for c in ranked[:top]]
    result["confirmed"] = confirmed
    result["winner"] = result["top"][0]
    result["command"] = "lit-titan train " + " ".join([*overrides, *ranked[0].overrides(callbacks)])
    result["runner_up_lost"] = why_lost(ranked[0], ranked[1]) if len(ranked) > 1 else "no runner-up"
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _confirm(fitting: list[Candidate], overrides: list[str], callbacks: list[str], eff, k: int) -> list[dict]:
    """Build the top ``k`` for real (TitanStrategy.parallelize over a fake process group): their per-rank
    parameter memory measured on the sharded tensors, and every check of the one-layout plan."""
    from lit_titan.config import compose
    from lit_titan.planner.core import make_plan_from_cfg

    out = []
    for c in fitting:
        if len(out) >= k:
            break
        ov = [*overrides, *c.overrides(callbacks)]
        try:
            plan = make_plan_from_cfg(compose(ov), overrides=ov, eff=eff)
        except ConfigError as err:
            plan = {"fits": False, "reasons": [str(err)], "per_rank": {}, "perf": {}}
        c.confirmed = {
            "layout": c.describe(),
            "fits": bool(plan["fits"]),
            "reasons": plan["reasons"],
            "param_bytes_built": plan["per_rank"].get("param_bytes"),
            "param_bytes_analytic": c.memory["param_bytes"],
            "max_total_bytes_built": plan.get("max_total_bytes"),
            "tokens_per_sec_built": (plan.get("perf") or {}).get("tokens_per_sec_per_device"),
        }
        out.append(c.confirmed)
    return out


def row(c: Candidate, callbacks: list[str]) -> dict[str, Any]:
    m, p = c.memory, c.perf
    return {
        "layout": c.describe(),
        "mesh": c.dims.as_dict(),
        "cp_mode": c.cp_mode,
        "schedule": c.schedule,
        "micro_batch": c.micro_batch,
        "accumulation": c.accumulation,
        "pp_microbatches": c.pp_microbatches,
        "ac_mode": c.ac_mode,
        "float8": c.float8,
        "grad_reduce_scatter": c.grad_reduce_scatter,
        "states_gib": (m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]) / GIB,
        "activations_gib": m["activation_bytes"] / GIB,
        "buffers_gib": m["fsdp_buffer_bytes"] / GIB,
        "max_total_gib": m["max_total_bytes"] / GIB,
        "step_s": p["step_s"],
        "tokens_per_sec_per_device": p["tokens_per_sec_per_device"],
        "mfu": p["mfu_bound"],
        "bubble": p["pp_bubble_fraction"],
        "terms": {k: p[k] for k, _ in TERMS},
        "overrides": c.overrides(callbacks),
        "confirmed": c.confirmed,
    }


def why_lost(winner: Candidate, runner: Candidate) -> str:
    """The runner-up's largest step-time deficit against the winner, in words."""
    w, r = winner.perf, runner.perf
    key, words = max(TERMS, key=lambda t: r[t[0]] - w[t[0]])
    slower = 1 - runner.tokens_per_sec / winner.tokens_per_sec
    return (
        f"runner-up {runner.describe()} predicts {slower:.1%} fewer tokens/s per GPU: mostly its {words} "
        f"({r[key]:.3g} s vs {w[key]:.3g} s per step; step {r['step_s']:.3g} s vs {w['step_s']:.3g} s)"
    )


def no_fit_message(cfg: DictConfig, cands: list[Candidate], cluster: dict[str, Any], world: int) -> str:
    capacity = _capacity(cluster)
    if not cands:
        return (
            f"plan search: no layout of {cfg.model.name} divides {world} devices with data.seq_len="
            f"{cfg.data.seq_len} and data.global_batch_size={cfg.data.global_batch_size}; make the global "
            f"batch a multiple of a data-parallel degree (e.g. {world}) or change cluster.devices/num_nodes"
        )
    best = min(cands, key=lambda c: c.memory["max_total_bytes"])
    need = best.memory["max_total_bytes"]
    factor = need / capacity
    return (
        f"plan search: no layout of {cfg.model.name} fits {world} x {cluster['hbm_gib']:g} GiB "
        f"(- {HBM_RESERVE_GIB:g} GiB reserve); closest is {best.describe()} needing {need / GIB:.1f} GiB per "
        f"device ({factor:.1f}x); use about {factor:.1f}x the devices (cluster.num_nodes / cluster.devices) or "
        f"HBM, or lower data.seq_len / data.global_batch_size"
    )


def render_search(result: dict[str, Any]) -> str:
    lines = [
        f"search: {result['model']} on {result['world_size']} devices: {result['candidates']} layouts, "
        f"{result['fitting']} fit {result['hbm_gib']:g} GiB - {result['reserve_gib']:g} GiB reserve "
        f"({result['seconds']:.1f} s; efficiencies: {result['efficiencies']['source']})",
        f"{'#':>2} {'layout':<58} {'states':>7} {'acts':>7} {'bufs':>6} {'max':>7} {'step s':>8} "
        f"{'tok/s/dev':>10} {'MFU':>6} {'bubble':>6}",
    ]
    for i, r in enumerate(result["top"], 1):
        mark = " *" if r["confirmed"] and r["confirmed"]["fits"] else ""
        lines.append(
            f"{i:>2} {r['layout']:<58} {r['states_gib']:7.1f} {r['activations_gib']:7.1f} "
            f"{r['buffers_gib']:6.1f} {r['max_total_gib']:7.1f} {r['step_s']:8.3g} "
            f"{r['tokens_per_sec_per_device']:10.1f} {r['mfu']:6.1%} {r['bubble']:6.1%}{mark}"
        )
    lines.append(
        "memory in GiB per device (states: params + grads + optimizer states; max: the most loaded pp rank); "
        "cpN: context parallel all-gather, cpNu Ulysses, cpNr ring; "
        "* confirmed by building it (TitanStrategy.parallelize on a meta model, fake process group)"
    )
    for c in result["confirmed"]:
        built, ana = c["param_bytes_built"], c["param_bytes_analytic"]
        agree = f"params {built / GIB:.2f} GiB built vs {ana / GIB:.2f} analytic" if built else "not built"
        lines.append(
            f"  confirm {c['layout']}: fits={c['fits']} ({agree})" + "".join(f"\n    - {r}" for r in c["reasons"])
        )
    lines.append(result["runner_up_lost"])
    lines.append("winner: " + result["command"])
    return "\n".join(lines)
