"""The plan: config checks collected as reasons, the measured layout, memory, FLOPs and step time."""

from __future__ import annotations

import time
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_titan.planner import estimate
from lit_titan.planner.estimate import GIB, HBM_RESERVE_GIB

REQUIRED_KEYS = ("world_size", "mesh", "params_total", "per_rank", "fits", "flops_per_token")


def _collect(reasons: list[str], fn, *a, **kw):
    """Run one check; a ValueError (ConfigError, LayoutError) becomes a reason instead of a crash."""
    try:
        return fn(*a, **kw)
    except ValueError as err:
        msg = str(err)
        if msg not in reasons:
            reasons.append(msg)
        return None


def _checks(cfg: DictConfig, args, dims, reasons: list[str], schema_checked: bool = False) -> None:
    """The checks of ``lit_titan.config.validate``, run one by one so that every failure is reported."""
    from lit_titan.config import validate
    from lit_titan.config.spec import batch_layout, pipeline_config

    seq_len = int(cfg.data.seq_len)
    if dims is not None:
        _collect(reasons, dims.validate, n_heads=args.n_heads)
        _collect(reasons, dims.validate, n_kv_heads=args.kv_heads)
        _collect(reasons, dims.validate, seq_len=seq_len)
        _collect(reasons, batch_layout, cfg, dims)
        if dims.pp > 1:
            micro = batch_layout(cfg, dims, check=False).micro
            _collect(
                reasons, lambda: pipeline_config(cfg).validate(pp=dims.pp, n_units=args.n_layers + 2, local_batch=micro)
            )
    # anything not covered above (precision, seq_len, max_steps, ...)
    _collect(reasons, lambda: validate(cfg, schema_checked=schema_checked))


def _instantiate_callbacks(cfg: DictConfig, reasons: list[str]) -> list:
    from lit_titan.job.build import instantiate

    out = []
    for name, node in (cfg.get("callbacks") or {}).items():
        try:
            out.append(instantiate(node))
        except Exception as err:  # noqa: BLE001 - reported, not raised
            reasons.append(f"callbacks.{name}: {type(err).__name__}: {err}")
    return out


def make_plan_from_cfg(
    cfg: DictConfig,
    overrides: list[str] | None = None,
    eff: estimate.Efficiencies | None = None,
    *,
    schema_checked: bool = False,
) -> dict[str, Any]:
    """The one-layout plan of ``cfg``; ``eff``: the step-time model's efficiencies (a calibration);
    ``schema_checked``: ``cfg`` came from ``compose(check=True)``."""
    from lit_titan.config.spec import model_args, parallel_dims, world_size
    from lit_titan.models.registry import flops_per_token
    from lit_titan.planner.build import build_layout

    t0 = time.perf_counter()
    reasons: list[str] = []
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    world = world_size(cfg)
    requested = {k: int(cfg.parallel[k]) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    plan: dict[str, Any] = {
        "model": str(cfg.model.name),
        "cluster": cluster,
        "precision": str(cfg.precision),
        "world_size": world,
        "mesh": requested,
        "params_total": None,
        "flops_per_token": None,
        "per_rank": {
            k: None
            for k in (
                "param_bytes",
                "grad_bytes",
                "optimizer_bytes",
                "activation_bytes",
                "fsdp_buffer_bytes",
                "total_bytes",
            )
        },
        "fits": False,
        "reasons": reasons,
        "overrides": list(overrides or []),
    }
    args = _collect(reasons, model_args, cfg)
    if args is None:
        return _finish(plan, t0)
    dims = _collect(reasons, parallel_dims, cfg)
    _checks(cfg, args, dims, reasons, schema_checked)
    callbacks = _instantiate_callbacks(cfg, reasons)
    seq_len = int(cfg.data.seq_len)
    from lit_titan.models.registry import count_params

    plan["params_total"] = count_params(args)
    plan["flops_per_token"] = flops_per_token(args, seq_len, num_params=plan["params_total"])
    if dims is None:
        return _finish(plan, t0)
    plan["mesh"] = dims.as_dict() | ({"ep": dims.ep} if dims.ep > 1 else {})
    try:
        layout = build_layout(cfg, args, dims, callbacks)
    except Exception as err:  # noqa: BLE001 - a layout torch refuses is a reason, not a crash
        reasons.append(f"TitanStrategy.parallelize failed: {type(err).__name__}: {err}")
        return _finish(plan, t0)
    plan["params_total"] = layout.params_total  # counted on the meta model itself
    plan["flops_per_token"] = flops_per_token(args, seq_len, num_params=layout.params_total)

    p = cfg.parallel
    precision = str(cfg.precision)
    from lit_titan.config.spec import batch_layout, pipeline_config

    batch = batch_layout(cfg, dims, check=False)  # a bad split is one of the reasons above
    global_batch, local_batch = batch.global_batch, batch.micro

    pcfg = pipeline_config(cfg)
    stages_per_rank = pcfg.per_rank if dims.pp > 1 else 1
    pp_micro = pcfg.microbatches_for(dims.pp) if dims.pp > 1 else 1
    micro = max(local_batch // pp_micro, 1) if dims.pp > 1 else local_batch
    reshard = bool(p.reshard_after_forward)
    accumulation = batch.accumulation  # Lightning micro-batches per step
    grad_reduce_scatter = str(p.get("grad_reduce_scatter", "every_microbatch"))
    cp_mode = str(p.get("cp_mode", "allgather"))

    # ---- memory (measured states + estimated activations and buffers), estimate.rank_memory ------
    from lit_titan.job.settings import LossConfig
    from lit_titan.models.loss import resolve_chunk_tokens
    from lit_titan.planner.optimizer_state import optimizer_states

    loss_chunk = resolve_chunk_tokens(
        (cfg.get("loss") or {}).get("chunk_tokens", LossConfig().chunk_tokens), args.vocab_size
    )
    states = optimizer_states(cfg)
    mem = estimate.rank_memory(
        args,
        dims,
        layout,
        precision=precision,
        seq_len=seq_len,
        micro_batch=micro,
        pp_microbatches=pp_micro,
        stages_per_rank=stages_per_rank,
        accumulation=accumulation,
        reshard_after_forward=reshard,
        grad_reduce_scatter=grad_reduce_scatter,
        loss_chunk_tokens=loss_chunk,
        document_masking=bool((cfg.get("data") or {}).get("document_masking", False)),
        optimizer_states=states,
        cp_mode=cp_mode,
    )
    param_bytes, grad_bytes, optimizer_bytes = mem["param_bytes"], mem["grad_bytes"], mem["optimizer_bytes"]
    buffers, act0 = mem["fsdp_buffer_bytes"], mem["activation_detail"]
    plan["per_rank"] = {
        "rank": 0,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_bytes,
        "activation_bytes": act0["total"],
        "fsdp_buffer_bytes": buffers,
        "total_bytes": mem["total_bytes"],
        "param_numel": layout.local_numel,
        "param_dtype": str(layout.param_dtype).replace("torch.", ""),
        "layers": layout.layers_on_rank,
        "stage_ids": layout.stage_ids,
        "activation_detail": act0,
        "example_parameters": layout.examples,
    }
    if dims.pp > 1:
        plan["per_pp_rank"] = mem["per_pp_rank"]
        plan["most_loaded_pp_rank"] = mem["most_loaded_pp_rank"]
    plan["max_total_bytes"] = mem["max_total_bytes"]

    hbm, plan["hbm_source"] = hbm_gib(cluster)
    plan["hbm_bytes"] = int(hbm * GIB) if hbm else None
    plan["reserve_bytes"] = int(HBM_RESERVE_GIB * GIB)
    if hbm:
        capacity = (hbm - HBM_RESERVE_GIB) * GIB
        if plan["max_total_bytes"] > capacity:
            unsharded_hint = (
                "keep gradients sharded (parallel.grad_reduce_scatter=every_microbatch), "
                if grad_bytes > param_bytes
                else ""
            )
            where = f"pp rank {plan.get('most_loaded_pp_rank', 0)}" if dims.pp > 1 else "rank 0"
            reasons.append(
                f"out of memory: {where} needs an estimated {plan['max_total_bytes'] / GIB:.1f} GiB "
                f"(params {param_bytes / GIB:.1f} + grads {grad_bytes / GIB:.1f} + {states.label} "
                f"{optimizer_bytes / GIB:.1f} + activations {act0['total'] / GIB:.1f} + FSDP buffers "
                f"{buffers / GIB:.1f} on rank 0) > {hbm:g} GiB HBM - {HBM_RESERVE_GIB:g} GiB reserve; "
                f"{unsharded_hint}shard more (parallel.tp/pp), checkpoint activations (mode=full) or "
                f"lower data.micro_batch_size"
            )
    else:  # not a reason against the layout: the fit is unknown (fits: null), said so
        on_gpu = cluster.get("accelerator") == "gpu"
        plan["fit_unknown"] = (
            "the cluster profile has no hbm_gib"
            + (" and no CUDA GPU is visible here" if on_gpu else f" (accelerator={cluster.get('accelerator')})")
            + "; add +cluster.hbm_gib=N (GiB per GPU), pick a profile such as cluster=h100_8"
            + (", or plan on the GPU machine" if on_gpu else "")
        )

    plan["perf"] = estimate.step_time(
        args,
        dims,
        cluster,
        layout,
        flops_per_token=plan["flops_per_token"],
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch=local_batch,
        pp_microbatches=pp_micro,
        stages_per_rank=stages_per_rank,
        ac_mode=layout.ac_mode,
        reshard_after_forward=reshard,
        precision=precision,
        grad_reduce_scatter=grad_reduce_scatter,
        optimizer=_optimizer_implementation(cfg, cluster, layout),
        float8=layout.float8_layers > 0,
        eff=eff or estimate.DEFAULT_EFFICIENCIES,
        cp_mode=cp_mode,
        optimizer_states=optimizer_states(cfg),
    )
    if dims.cp > 1:
        plan["context_parallel"] = _context_parallel(args, dims, micro, seq_len, cp_mode, precision, plan["perf"])
    plan["gradients"] = {
        "accumulation": accumulation,
        "grad_reduce_scatter": grad_reduce_scatter,
        "unsharded_between_micro_batches": grad_bytes > param_bytes,
    }
    plan["transforms"] = {
        "activation_checkpointing": layout.ac_mode,
        "compile": layout.compiled,
        "float8_linears": layout.float8_layers,
    }
    plan["pipeline"] = (
        {
            "schedule": pcfg.schedule,
            "stages_per_rank": stages_per_rank,
            "microbatches": pp_micro,
            "num_stages": layout.num_stages,
        }
        if dims.pp > 1
        else None
    )
    plan["batch"] = {
        "global_batch_size": global_batch,
        "local_batch_size": local_batch,
        "micro_batch": micro,
        "seq_len": seq_len,
    }
    e = eff or estimate.DEFAULT_EFFICIENCIES
    plan["assumptions"] = {
        "compute_efficiency": e.compute,
        "comm_efficiency": e.comm,
        "efficiencies": e.as_dict(),
        "hbm_reserve_gib": HBM_RESERVE_GIB,
        "hbm_efficiency": e.hbm,
        "adamw_tensor_passes": estimate.ADAMW_TENSOR_PASSES,
        "bandwidth_units": "GB/s per GPU per direction (cluster.intra_node_gbps / inter_node_gbps)",
        "not_modelled": "FP8 all-gather savings, compile's memory savings, async TP, "
        "pipeline p2p, the optimizer step on the CPU (cpu_offload)",
    }
    return _finish(plan, t0)


def _context_parallel(args, dims, micro: int, seq_len: int, mode: str, precision: str, perf: dict) -> dict[str, Any]:
    """What the CP mode keeps, holds and sends per block (planner/cp_modes.py), and its step-time share."""
    from lit_titan.planner import cp_modes

    out = cp_modes.summary(
        args, s=seq_len, b=micro, t=dims.tp, cp=dims.cp, mode=mode, act_elem=estimate.activation_elem_bytes(precision)
    )
    if perf.get("available"):
        out.update(comm_s=perf["cp_comm_total_s"], exposed_s=perf["cp_comm_s"])
    return out


def hbm_gib(cluster: dict[str, Any]) -> tuple[float | None, str | None]:
    """Memory per GPU and where it came from: the profile's ``hbm_gib``, else this machine's GPU.

    A GPU profile without the fact (``cluster=gpu_1``) describes the GPU the job runs on, so when
    one is visible its memory is the answer; otherwise it is unknown (None).
    """
    if cluster.get("hbm_gib"):
        return float(cluster["hbm_gib"]), "cluster.hbm_gib"
    import torch

    if cluster.get("accelerator") == "gpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory / GIB, f"torch.cuda.get_device_properties: {props.name}"
    return None, None


def _optimizer_implementation(cfg: DictConfig, cluster: dict[str, Any], layout) -> str:
    """The AdamW kernel training will build (lit_titan.optim.build.adamw_implementation) for the profile's device."""
    from types import SimpleNamespace

    import torch

    from lit_titan.optim.build import adamw_implementation

    on_gpu = cluster.get("accelerator") == "gpu" and not cfg.parallel.get("cpu_offload", False)
    param = SimpleNamespace(device=torch.device("cuda" if on_gpu else "cpu"), dtype=layout.param_dtype)
    return adamw_implementation([param], fused=cfg.optim.get("fused"), foreach=cfg.optim.get("foreach"))


def _finish(plan: dict[str, Any], t0: float) -> dict[str, Any]:
    """``fits``: False with any reason, None (unknown) without memory facts, else True."""
    judged = plan["per_rank"]["total_bytes"] is not None
    if plan["reasons"] or not judged:
        plan["fits"] = False
    else:
        plan["fits"] = None if plan.get("fit_unknown") else True
    plan["plan_seconds"] = round(time.perf_counter() - t0, 3)
    return plan


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:8.2f} GiB"


def render_table(plan: dict[str, Any]) -> str:
    m = plan["mesh"]
    pr = plan["per_rank"]
    lines = [
        f"plan: {plan['model']} on {plan['world_size']} x {plan['cluster'].get('accelerator')} ({plan['precision']})",
        "mesh: " + "  ".join(f"{k}={v}" for k, v in m.items()),
        f"params_total: {plan['params_total']:,}" if plan["params_total"] else "params_total: -",
        f"flops_per_token: {plan['flops_per_token']:.4g}" if plan["flops_per_token"] else "flops_per_token: -",
        "per rank (rank 0):",
    ]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "fsdp_buffer_bytes", "total_bytes"):
        lines.append(f"  {key:<18} {_gib(pr.get(key))}")
    if plan.get("hbm_bytes"):
        lines.append(
            f"  {'hbm (reserve)':<18} {_gib(plan['hbm_bytes'])} ({_gib(plan['reserve_bytes']).strip()}; "
            f"from {plan['hbm_source']})"
        )
    for row in plan.get("per_pp_rank", []):
        lines.append(
            f"  pp rank {row['pp_rank']}: {row['layers']} blocks{' +head' if row['has_output'] else ''}"
            f"  total {_gib(row['total_bytes'])}"
        )
    perf = plan.get("perf") or {}
    if perf.get("available"):
        lines.append(
            f"step: {perf['step_s']:.2f} s (compute {perf['compute_s']:.2f}, fsdp {perf['fsdp_comm_s']:.2f} "
            f"[{perf['fsdp_link']}], tp {perf['tp_comm_s']:.2f}, "
            + (f"ep all-to-all {perf['ep_comm_s']:.2f} [{perf['ep_link']}], " if perf.get("ep_comm_s") else "")
            + f"bubble {perf['pp_bubble_fraction']:.1%}, "
            f"optimizer {perf['optimizer_s']:.3f} [{perf['optimizer']}])  "
            f"tokens/s/device {perf['tokens_per_sec_per_device']:.0f}  MFU bound {perf['mfu_bound']:.1%}"
        )
        if perf.get("muon_flops"):
            lines.append(
                f"muon: {perf['muon_s']:.2f} s per step (Newton-Schulz {perf['muon_flops'] / 1e12:,.0f} TFLOP at "
                f"{perf['muon_fp32_flops_per_s'] / 1e12:.0f} TFLOP/s fp32: {perf['muon_newton_schulz_s']:.2f} s; "
                f"gather {perf['muon_gather_bytes'] / 1e9:.1f} GB fp32: {perf['muon_gather_s']:.2f} s; "
                f"every rank orthogonalises {perf['muon_matrix_numel'] / 1e9:.2f}B elements)"
            )
    cp = plan.get("context_parallel")
    if cp:
        timing = f"; {cp['exposed_s']:.3f} s of {cp['comm_s']:.3f} s per step exposed" if "comm_s" in cp else ""
        lines.append(
            f"context parallel {cp['mode']}: per block and micro-batch, K/V kept beyond the local slice "
            f"{cp['kept_kv_bytes_per_block'] / 2**20:.1f} MiB, backward transient "
            f"{cp['backward_transient_bytes'] / 2**20:.1f} MiB, sent {cp['comm_bytes_per_block'] / 2**20:.1f} MiB "
            f"(fwd+bwd, {'overlapped with attention' if cp['overlapped'] else 'exposed'}){timing}"
        )
    if plan["fits"] is None:
        lines.append(f"fit unknown: {plan['fit_unknown']}")
    else:
        lines.append(f"fits: {plan['fits']}")
    for r in plan["reasons"]:
        lines.append(f"  - {r}")
    if plan.get("plan_path"):
        lines.append(f"wrote {plan['plan_path']}")
    return "\n".join(lines)
