"""Closed-form estimates on top of the measured layout: activations, transient buffers, step time.

Every formula is spelled out in docs/planner.md; the short version:

Activations: the per-block counts of docs/planner.md ("Activations"), adapted from Korthikanti et
al. 2022 (arXiv:2205.05198) for Llama with SDPA, 16-bit (x2 for fp32 training), and checked against
CPU measurement by benchmarks/activation_memory_cpu.py (within 15%, tests/unit/planner/test_plan.py). In short:
none s*b*(16h + 4h_kv + 8f)/(t*cp), selective_op s*b*(10h + 4h_kv + 4f)/(t*cp), full 2*s*b*h/(t*cp),
plus what TP/CP keep gathered, the embedding output, and the larger of the loss's peak
(12*tokens*V/t, or one chunk's) and one block's backward (its gradients, plus its recomputation).
Under pipeline parallelism the first pipeline rank holds L blocks' worth (1F1B) or
L*(1 + (p-1)/(p*v)) for v > 1 stages per rank, never more than m in-flight micro-batches.
With SDPA, sliding-window and document masks are dense bools the model builds (attention_mask_bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lit_titan.data.batch_layout import BatchLayout
from lit_titan.observe.throughput import peak_flops  # noqa: F401 - also this module's API
from lit_titan.planner import cp_modes, moe
from lit_titan.planner.optimizer_state import OptimizerStates, muon_cost

GIB = 1024**3

# Assumptions of the step-time model (stated in plan.json under "assumptions").
COMPUTE_EFFICIENCY = 0.6  # achievable fraction of dense BF16 peak for large matmuls
COMM_EFFICIENCY = 0.8  # achievable fraction of link bandwidth for ring collectives
HBM_RESERVE_GIB = 6.0  # CUDA context + NCCL buffers + allocator fragmentation, not available to tensors
HBM_EFFICIENCY = 0.8  # achievable fraction of HBM bandwidth for a streaming elementwise kernel
# AdamW step, tensor passes over HBM per parameter element (each of param, grad, exp_avg, exp_avg_sq
# read or written counts one): the fused kernel reads the four and writes param and both moments (7);
# torch's foreach AdamW (torch/optim/adam.py, _multi_tensor_adam, no capturable) runs a kernel per op:
# param *= 1-lr*wd (2), exp_avg.lerp_(grad) (3), exp_avg_sq *= beta2 (2), addcmul_(grad, grad) (3),
# sqrt (2), div_ (2), add_ eps (2), param.addcdiv_(exp_avg, denom) (4) = 20. At 1.92B fp32 parameters on
# an H100 (3.35 TB/s x 0.8) that is 20 vs 57 ms: 37 ms apart, close to the measured gap (docs/planner.md).
ADAMW_TENSOR_PASSES = {"fused": 7, "foreach": 20, "for_loop": 20}


@dataclass(frozen=True)
class Efficiencies:
    """The step-time model's free parameters: defaults are assumptions, a calibration file replaces them.

    ``float8_linear_speedup``: how much faster the block Linears' matmuls run under Float8 than in
    bf16 (1.0: not modelled). ``overhead_s``: fixed per-step host time (Lightning's loop, hooks,
    logging; dominant for tiny CPU models, negligible at fleet scale). ``expert_imbalance``: max/mean
    tokens per routed expert (1.0: perfectly balanced; the run report's expert-load figure measures it),
    stretching expert compute and the all-to-all under expert parallel (planner/moe.py).
    ``source`` says where they came from.
    """

    compute: float = COMPUTE_EFFICIENCY
    comm: float = COMM_EFFICIENCY
    hbm: float = HBM_EFFICIENCY
    float8_linear_speedup: float = 1.0
    overhead_s: float = 0.0
    expert_imbalance: float = 1.0
    source: str = "defaults (lit_titan/planner/estimate.py)"

    def with_(self, **kw: Any) -> Efficiencies:
        return replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_EFFICIENCIES = Efficiencies()


def with_expert_imbalance(eff, value: str | float | None):
    """``eff`` (None: the defaults) with ``plan.expert_imbalance=value``; ConfigError for a value below 1."""
    from lit_titan.errors import ConfigError

    if value is None:
        return eff
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not x >= 1.0:  # NaN too
        raise ConfigError(
            f"plan.expert_imbalance={value}: not a max/mean ratio of tokens per expert (a number >= 1); use e.g. "
            f"plan.expert_imbalance=1.0 (balanced) or the max/mean the run report shows"
        )
    return (eff or DEFAULT_EFFICIENCIES).with_(expert_imbalance=x)


def float8_flops_per_token(args) -> float:
    """Training FLOPs per token of the transformer blocks' Linears, the ones Float8 converts
    (the output head stays bf16, as in TorchTitan and lit_titan.callbacks.Float8)."""
    h, hd, f = args.dim, args.head_dim, args.ffn_hidden_dim
    linear = h * args.n_heads * hd * 2 + h * args.kv_heads * hd * 2 + 3 * h * f
    return 6.0 * args.n_layers * linear


def per_block_activation_bytes(args, s: int, b: int, t: int, cp: int, mode: str, cp_mode: str = "allgather") -> float:
    h, h_kv, f = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    tokens = s * b / (t * cp)
    # Kept whole on each rank, not split by t or cp (measured, benchmarks/activation_memory_cpu.py):
    # under TP the two linear inputs are the all-gathered sequence (sequence parallel gathers before
    # wq/wk/wv and w1/w3, and autograd keeps the gathered tensor); under CP all-gather attention keeps
    # the keys and values of the whole sequence (ulysses and ring do not: planner/cp_modes.py).
    gathered = s * b / cp * 2 * h * 2 * (1 - 1 / t) + cp_modes.kept_kv_bytes(args, s, b, t, cp, cp_mode)
    routed = moe.routed_activation_bytes_per_token(args)  # an MoE layer's routed copies (0: dense)
    if mode == "none":
        return tokens * (16 * h + 4 * h_kv + 8 * f + routed) + gathered
    if mode == "selective_op":
        return tokens * (10 * h + 4 * h_kv + 4 * f + routed) + gathered
    if mode == "full":
        return tokens * 2 * h
    raise ValueError(mode)


def attention_mask_bytes(
    args,
    seq_len: int,
    micro_batch: int,
    *,
    document_masking: bool,
    cp: int = 1,
    act_elem: int = 2,
    layers_kept: float = 0.0,
) -> dict[str, int]:
    """Dense masks of the SDPA path (lit_titan/models/llama3/attention.py): the bools the model builds and
    the additive copies SDPA saves for backward.

    Plain causal SDPA passes ``is_causal`` and FlexAttention a block mask: nothing dense. Without documents
    each windowed layer's mask is the cached [s, s] bool ``window_mask`` (kept for the run, shared by the
    layers of one window); with documents every distinct window (full causal included) keeps its cached
    [s, s] band and this forward's [b, 1, s, s] mask. SDPA turns a bool mask into an additive one in the
    query dtype (``act_elem`` bytes per element) and saves it for backward, one per masked layer call
    (measured on CPU, tests/unit/planner/test_plan_masks.py): ``layers_kept`` layers' worth stay alive, and one more
    while a checkpointed block recomputes. At s = 32768 one [s, s] bool is 1 GiB, its bf16 copy 2 GiB.
    Under CP the CP core builds its own masks per chunk (not counted here).
    """
    none = {"bool": 0, "saved": 0, "per_layer": 0}
    if getattr(args, "attention", "sdpa") != "sdpa" or cp > 1:
        return none
    s, b = seq_len, micro_batch
    layer_windows = [args.window_of(i) for i in range(args.n_layers)]
    windows = set(layer_windows)
    if document_masking:
        bools = len(windows) * (s * s + b * s * s)
        masked = [b * s * s] * args.n_layers
    else:
        bools = sum(s * s for w in windows if w is not None)
        masked = [s * s if w is not None else 0 for w in layer_windows]
    mean = sum(masked) / len(masked)
    return {"bool": int(bools), "saved": int(mean * act_elem * layers_kept), "per_layer": int(max(masked) * act_elem)}


def backward_temp_bytes(args, s: int, b: int, t: int, cp: int) -> float:
    """Gradients alive inside one block's backward (16-bit count): those of its input and output and of
    the MLP's two hidden activations, 2*s*b*(2h + 2f)/(t*cp)."""
    return s * b / (t * cp) * 2 * (2 * args.dim + 2 * args.ffn_hidden_dim)


def activation_elem_bytes(precision: str) -> int:
    """Bytes per activation element: the formulas count 16-bit activations; fp32 training keeps 4."""
    return 4 if str(precision).split("-")[0] in ("32", "64") else 2


def activation_bytes(
    args,
    dims,
    *,
    seq_len: int,
    micro_batch: int,
    mode: str,
    every_n_layers: int,
    layers_on_rank: int,
    has_output: bool,
    pp_microbatches: int,
    stages_per_rank: int,
    loss_chunk_tokens: int = 0,
    act_elem: int = 2,
    document_masking: bool = False,
    cp_mode: str = "allgather",
) -> dict[str, Any]:
    t, cp, p, v = dims.tp, dims.cp, dims.pp, stages_per_rank
    width = act_elem / 2  # the per-block formulas count 16-bit elements
    s, b = seq_len, micro_batch
    if mode == "selective_layer":
        n_ckpt = (layers_on_rank + every_n_layers - 1) // every_n_layers
        mixed = n_ckpt * per_block_activation_bytes(args, s, b, t, cp, "full") + (
            layers_on_rank - n_ckpt
        ) * per_block_activation_bytes(args, s, b, t, cp, "none", cp_mode)
        per_block = mixed / max(layers_on_rank, 1)
    else:
        per_block = per_block_activation_bytes(args, s, b, t, cp, mode, cp_mode)
    if p > 1:
        # blocks' worth of activations held at the peak by the first pipeline rank
        in_flight = args.n_layers * ((1 + (p - 1) / (p * v)) if v > 1 else 1.0)
        in_flight = min(in_flight, layers_on_rank * pp_microbatches)  # at most m micro-batches per block
    else:
        in_flight = layers_on_rank
    per_block *= width
    blocks = per_block * in_flight
    recompute_peak = width * per_block_activation_bytes(args, s, b, t, cp, "none", cp_mode) if mode != "none" else 0.0
    recompute_peak += width * backward_temp_bytes(args, s, b, t, cp)  # a block's backward, recomputed or not
    recompute_peak += cp_modes.backward_transient_bytes(args, s, b, t, cp, cp_mode, act_elem)  # ring's blocks
    embedding = act_elem * s * b * args.dim / (t * cp)
    # The loss's tokens per rank: all of them, or one chunk at a time (loss.chunk_tokens, lit_titan/models/loss.py).
    loss_tokens = s * b / cp if not loss_chunk_tokens else min(loss_chunk_tokens, s * b / cp)
    loss = 12 * loss_tokens * args.vocab_size / t if has_output else 0.0
    # The loss's buffers are freed before the first block's backward recomputes it: two peaks, not one.
    # layers whose SDPA inputs stay saved until backward: all but the checkpointed ones (their masks are
    # rebuilt in the recomputation, one block at a time)
    kept = {"none": 1.0, "selective_op": 1.0, "full": 0.0}.get(mode)
    if kept is None:  # selective_layer
        n_ckpt = (layers_on_rank + every_n_layers - 1) // every_n_layers
        kept = (layers_on_rank - n_ckpt) / max(layers_on_rank, 1)
    masks = attention_mask_bytes(
        args, s, b, document_masking=document_masking, cp=cp, act_elem=act_elem, layers_kept=in_flight * kept
    )
    if mode != "none":
        recompute_peak += masks["per_layer"]
    total = blocks + embedding + max(loss, recompute_peak) + masks["bool"] + masks["saved"]
    return {
        "total": int(total),
        "blocks": int(blocks),
        "blocks_in_flight": in_flight,
        "attention_mask": masks["bool"] + masks["saved"],
        "attention_mask_detail": masks,
        "per_block": int(per_block),
        "recompute_peak": int(recompute_peak),
        "embedding": int(embedding),
        "loss": int(loss),
        "micro_batch": b,
        "mode": mode,
    }


def fsdp_buffer_bytes(layout, dims, precision: str, reshard_after_forward: bool) -> int:
    """Transient unsharded parameters/gradients FSDP holds (not counted by the sharded tensors).

    Under PP the strategy forces reshard_after_forward=False: every unit of the rank's stages stays
    all-gathered from forward to backward. Otherwise two units are gathered at a time (current +
    prefetched) and one unit's full-size fp32 gradient exists before its reduce-scatter.
    """
    if not layout.fsdp_applied or dims.fsdp_size == 1:
        return 0
    gather = 4 if precision == "32-true" else 2
    grad = 2 if precision == "bf16-true" else 4
    if dims.pp > 1 or not reshard_after_forward:
        return int(unsharded_numel(layout, dims) * gather + layout.largest_unit_numel * grad)
    return int(2 * layout.largest_unit_numel * gather + layout.largest_unit_numel * grad)


def unsharded_numel(layout, dims) -> int:
    """This rank's parameters all-gathered by FSDP: over dp_shard*cp, routed experts over efsdp only."""
    experts = layout.expert_numel if dims.ep > 1 else 0
    return (layout.local_numel - experts) * dims.fsdp_size + experts * dims.efsdp


def gradient_bytes(
    layout, dims, precision: str, sharded_bytes: int, *, accumulation: int, grad_reduce_scatter: str
) -> int:
    """Gradient storage per rank between micro-batches (parallel.grad_reduce_scatter).

    FSDP2 keeps sharded gradients in the sharded parameter's dtype (``sharded_bytes``). With
    ``last_microbatch`` and gradient accumulation, FSDP's sync is off until the last micro-batch and
    every rank holds the *unsharded* gradients of its model (this rank's TP/PP part, all-gathered
    over dp_shard*cp) in the reduce dtype instead; the sharded ones are built from them unit by unit.
    Under PP torch's schedule reduces after every schedule step, so gradients stay sharded.
    """
    if grad_reduce_scatter != "last_microbatch" or accumulation <= 1 or dims.pp > 1 or not layout.fsdp_applied:
        return sharded_bytes
    reduce_elem = 2 if precision == "bf16-true" else 4
    return unsharded_numel(layout, dims) * reduce_elem


def step_time(
    args,
    dims,
    cluster,
    layout,
    *,
    flops_per_token: float,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    pp_microbatches: int,
    stages_per_rank: int,
    ac_mode: str,
    reshard_after_forward: bool,
    precision: str,
    grad_reduce_scatter: str = "every_microbatch",
    optimizer: str = "fused",
    float8: bool = False,
    eff: Efficiencies = DEFAULT_EFFICIENCIES,
    cp_mode: str = "allgather",
    optimizer_states: OptimizerStates | None = None,
) -> dict[str, Any]:
    """A deliberately simple bound: compute, exposed communication, pipeline bubble.

    compute   = model FLOPs of the rank's share of the step * recompute factor / (peak * efficiency)
    fsdp_comm = (all-gathers + reduce-scatters) * (n-1)/n * unsharded bytes / bandwidth of the slowest
                link the dp_shard*cp group spans; overlapped with compute (prefetch) -> max(compute, comm);
                reduce-scatters: one per micro-batch (every_microbatch, and always under PP), else one
    optimizer = AdamW tensor passes (ADAMW_TENSOR_PASSES, by the kernel training picks) x the rank's
                parameter bytes / HBM bandwidth (cluster.hbm_gbps); after the pipelined part
    muon      = optim=muon (``optimizer_states``): every rank gathers each hidden matrix of its stages whole
                (fp32, (n-1)/n of it over the fsdp x tp ranks that split it, on their link) and runs
                Newton-Schulz on it at the fp32 rate (the rate of ring's fp32 kernel, planner/cp_modes.py);
                exposed, after the pipelined part (planner/optimizer_state.py)
    tp_comm   = per block and micro-batch 4 collectives forward, 4 backward (+4 when recomputed), halved with
                model.parallel_block (one all-gather and one reduce-scatter serve both branches), each
                (t-1)/t * 2*s*b*h bytes over NVLink (or IB if the TP group spans nodes); exposed
    cp_comm   = per block, forward + backward, by parallel.cp_mode (planner/cp_modes.py): all-gather of K/V
                or Ulysses' all-to-alls, exposed; ring's K/V blocks, exposed only beyond the block's attention,
                plus ring's fp32 per-block kernel's extra time over the model's attention FLOPs
    ep_comm   = per MoE layer and micro-batch 4 all-to-alls (dispatch + combine, forward + backward; +2
                recomputed under full AC), each tokens x top_k x dim x 2 bytes x (ep-1)/ep x rank imbalance
                (planner/moe.py), over the ep x tp ranks' link; exposed. The rank imbalance (expert
                imbalance, capped at ep) also stretches the routed experts' compute
    bubble    = (p-1)/(m*v + p-1) of the pipelined time;
    share     = processes per node / cores_per_node when above 1 (CPU profiles): scales compute and overhead
    hsdp      = all-reduce of the gradient shards over dp_replicate (once per step), exposed
    step      = (max(compute, fsdp) + tp + cp + ep) / (1 - bubble) + hsdp + optimizer + muon + overhead

    The efficiencies (compute, comm, hbm, Float8 speed-up, overhead) come from ``eff``: the defaults
    or a calibration file (lit_titan/planner/calibrate.py).
    """
    peak = peak_flops(cluster, precision)
    intra = float(cluster.get("intra_node_gbps") or 0) * 1e9
    inter = float(cluster.get("inter_node_gbps") or 0) * 1e9
    per_node = int(cluster.get("gpus_per_node") or cluster.get("devices") or 1)
    if not peak or not intra:
        return {
            "available": False,
            "why": "cluster profile lacks peak_bf16_tflops (peak_fp32_tflops) / intra_node_gbps",
        }

    def bandwidth(span: int) -> float:
        return (intra if span <= per_node or not inter else inter) * eff.comm

    tokens_step = global_batch * seq_len
    recompute = {"none": 1.0, "selective_op": 1.0, "full": 4 / 3}.get(ac_mode, 1.0)
    if ac_mode == "selective_layer":
        recompute = 1 + (1 / 3) / 2
    rank_flops = flops_per_token * tokens_step / dims.world_size
    f8_flops = float8_flops_per_token(args) * tokens_step / dims.world_size if float8 else 0.0
    effective = rank_flops - f8_flops + f8_flops / eff.float8_linear_speedup
    # expert parallel: the most loaded rank computes its experts' tokens, imbalance x the mean share
    imbalance = moe.rank_imbalance(eff.expert_imbalance, dims.ep)
    expert_flops = moe.expert_flops_per_token(args) * tokens_step / dims.world_size
    effective += expert_flops * (imbalance - 1)
    compute_s = effective * recompute / (peak * eff.compute)
    # CPU profiles: more processes per node than cores share them (cluster.cores_per_node)
    share = max(float(cluster.get("devices") or 1) / float(cluster.get("cores_per_node") or 1e9), 1.0)
    compute_s *= share

    dp_local = global_batch // dims.dp  # sequences per dp rank per step
    accumulation = BatchLayout.derive(global_batch, micro_batch, dims.dp, check=False).accumulation
    # FSDP: the dp_shard_cp group is strided by tp (tp innermost), so it spans fsdp*tp consecutive ranks
    n = dims.fsdp_size
    reduce_scatters = 1 if grad_reduce_scatter == "last_microbatch" and dims.pp == 1 else accumulation
    fsdp_s = 0.0
    if layout.fsdp_applied and n > 1:
        gathers = accumulation * (1 if dims.pp > 1 or not reshard_after_forward else 2)
        experts = layout.expert_numel if dims.ep > 1 else 0  # gathered over efsdp, the rest over n
        volume = 0.0
        for numel, group in ((layout.local_numel - experts, n), (experts, dims.efsdp)):
            gather_bytes = numel * group * (4 if precision == "32-true" else 2)
            grad_bytes = numel * group * (2 if precision == "bf16-true" else 4)
            volume += (group - 1) / group * (gathers * gather_bytes + reduce_scatters * grad_bytes)
        fsdp_s = volume / bandwidth(n * dims.tp)
    # TP (+SP): 4 collectives per block forward (2 all-gather, 2 reduce-scatter), 4 backward
    tp_s = 0.0
    if dims.tp > 1:
        per_coll = (dims.tp - 1) / dims.tp * 2 * dp_local * seq_len / dims.cp * args.dim
        colls = 8 + (4 if ac_mode == "full" else 0)
        if getattr(args, "parallel_block", False):  # one gather of norm(x), one reduction of attn + mlp
            colls //= 2
        tp_s = layout.layers_on_rank * colls * per_coll / bandwidth(dims.tp)
    cp = cp_modes.cp_time(
        args,
        s=seq_len,
        b=dp_local,
        t=dims.tp,
        cp=dims.cp,
        mode=cp_mode,
        layers=layout.layers_on_rank,
        bandwidth=bandwidth(dims.cp * dims.tp),
        flops_per_s=peak * eff.compute / share,
        kernel_flops_per_s=cp_modes.ring_kernel_rate(cluster, precision, peak * eff.compute, eff.compute) / share,
    )
    cp_s = cp["exposed_s"] + cp["kernel_s"]  # ring: exposed transfers + its fp32 kernel's extra time
    ep_s = 0.0
    if dims.ep > 1:  # every rank routes its own tokens (dp x cp share the step's; tp ranks repeat them)
        moe_layers = len(moe.moe_layers(args)) * layout.layers_on_rank / args.n_layers
        a2a = moe.all_to_all_bytes(
            args, tokens=tokens_step / (dims.dp * dims.cp), ep=dims.ep, expert_imbalance=eff.expert_imbalance
        )
        colls = moe.A2A_PER_LAYER + (moe.A2A_RECOMPUTED if ac_mode == "full" else 0)
        ep_s = moe_layers * colls * a2a / bandwidth(dims.ep * dims.tp)
    bubble = 0.0
    if dims.pp > 1:
        m, p, v = pp_microbatches, dims.pp, stages_per_rank
        bubble = (p - 1) / (m * v + p - 1)
    busy = max(compute_s, fsdp_s) + tp_s + cp_s + ep_s
    hsdp_s = 0.0
    if dims.dp_replicate > 1:  # HSDP: the replicas all-reduce their gradient shards, across nodes
        shard_grad = layout.local_numel * (2 if precision == "bf16-true" else 4)
        span = dims.dp_replicate * dims.fsdp_size * dims.tp
        hsdp_s = 2 * (dims.dp_replicate - 1) / dims.dp_replicate * shard_grad / bandwidth(span)
    # AdamW on this rank's shard: memory-bound. Not modelled on the host (cpu_offload: for_loop on CPU).
    hbm_bw = float(cluster.get("hbm_gbps") or 0) * 1e9 * eff.hbm
    state_bytes = layout.local_param_bytes if precision != "bf16-true" else layout.local_numel * 2
    optimizer_s = ADAMW_TENSOR_PASSES[optimizer] * state_bytes / hbm_bw if hbm_bw and optimizer != "for_loop" else 0.0
    muon = _muon_time(args, dims, cluster, layout, precision, eff, share, bandwidth, optimizer_states)
    step_s = busy / (1 - bubble) + hsdp_s + optimizer_s + muon["muon_s"] + eff.overhead_s * share
    mfu = rank_flops / (step_s * peak)
    return {
        "available": True,
        "step_s": step_s,
        "compute_s": compute_s,
        "fsdp_comm_s": fsdp_s,
        "tp_comm_s": tp_s,
        "cp_comm_s": cp_s,
        "cp_comm_total_s": cp["comm_s"],
        "cp_kernel_s": cp["kernel_s"],
        "cp_mode": cp_mode,
        "ep_comm_s": ep_s,
        "expert_rank_imbalance": imbalance,
        "hsdp_comm_s": hsdp_s,
        "overhead_s": eff.overhead_s,
        "exposed_fsdp_s": max(fsdp_s - compute_s, 0.0),
        "bubble_s": busy / (1 - bubble) - busy,
        "pp_bubble_fraction": bubble,
        "recompute_factor": recompute,
        "tokens_per_step": tokens_step,
        "tokens_per_sec_per_device": tokens_step / step_s / dims.world_size,
        "mfu_bound": mfu,
        "gradient_accumulation": accumulation,
        "fsdp_reduce_scatters": reduce_scatters,
        "optimizer": optimizer,
        "optimizer_s": optimizer_s,
        **muon,
        "fsdp_link": "nvlink" if n * dims.tp <= per_node else "infiniband",
        "tp_link": "nvlink" if dims.tp <= per_node else "infiniband",
        "ep_link": "nvlink" if dims.ep * dims.tp <= per_node else "infiniband",
    }


def _muon_time(args, dims, cluster, layout, precision, eff, share, bandwidth, states) -> dict[str, Any]:
    """Muon's gathered orthogonalisation per step (step_time's ``muon`` term); zeros for other optimizers."""
    if states is None or states.name != "muon":
        return {"muon_s": 0.0}
    split = dims.fsdp_size * dims.tp  # FSDP (dp_shard x cp) and TP split every hidden matrix
    cost = muon_cost(args, layers=layout.layers_on_rank, split=split, ns_steps=states.ns_steps)
    peak = peak_flops(cluster, precision)
    rate = cp_modes.ring_kernel_rate(cluster, precision, peak * eff.compute, eff.compute) / share
    ns_s = cost["flops"] / rate
    gather_s = cost["gather_bytes"] / bandwidth(split) if split > 1 else 0.0
    return {
        "muon_s": ns_s + gather_s,
        "muon_newton_schulz_s": ns_s,
        "muon_gather_s": gather_s,
        "muon_flops": cost["flops"],
        "muon_gather_bytes": cost["gather_bytes"],
        "muon_matrix_numel": cost["matrix_numel"],
        "muon_fp32_flops_per_s": rate,
    }


def rank_memory(
    args,
    dims,
    layout,
    *,
    precision: str,
    seq_len: int,
    micro_batch: int,
    pp_microbatches: int,
    stages_per_rank: int,
    accumulation: int,
    reshard_after_forward: bool,
    grad_reduce_scatter: str,
    loss_chunk_tokens: int = 0,
    document_masking: bool = False,
    optimizer_states: OptimizerStates | None = None,
    cp_mode: str = "allgather",
) -> dict[str, Any]:
    """Per-rank memory of a layout: rank 0's breakdown, every pipeline rank's total, and the maximum.

    ``optimizer_states``: the optimizer and its state dtype (``planner/optimizer_state.py``; None: AdamW with
    states in the parameters' dtype).

    One function for both the one-layout plan (``layout`` measured on the meta model) and the search
    (``layout`` from :func:`lit_titan.planner.analytic.analytic_layout`), so the two cannot disagree.
    """
    state_elem = 2 if precision == "bf16-true" else layout.local_param_bytes // max(layout.local_numel, 1)
    param_bytes = layout.local_numel * state_elem
    grad_bytes = gradient_bytes(
        layout, dims, precision, param_bytes, accumulation=accumulation, grad_reduce_scatter=grad_reduce_scatter
    )
    optimizer_bytes = (optimizer_states or OptimizerStates()).bytes(
        layout.local_numel, layout.local_matrix_numel, state_elem
    )
    buffers = fsdp_buffer_bytes(layout, dims, precision, reshard_after_forward)

    def acts(layers: int, has_output: bool) -> dict[str, Any]:
        return activation_bytes(
            args,
            dims,
            seq_len=seq_len,
            micro_batch=micro_batch,
            mode=layout.ac_mode,
            every_n_layers=layout.ac_every_n_layers,
            layers_on_rank=layers,
            has_output=has_output,
            pp_microbatches=pp_microbatches,
            stages_per_rank=stages_per_rank,
            loss_chunk_tokens=loss_chunk_tokens,
            act_elem=activation_elem_bytes(precision),
            document_masking=document_masking,
            cp_mode=cp_mode,
        )

    act0 = acts(layout.layers_on_rank, layout.pp_rank_has_output[0])
    total0 = param_bytes + grad_bytes + optimizer_bytes + act0["total"] + buffers
    # Other pipeline ranks: states scaled by their stages' parameter count (same FSDP/TP split as
    # rank 0), activations by the first rank's in-flight count (an upper bound for later ranks),
    # plus the loss buffers on the rank holding the output head.
    per_pp = []
    if dims.pp > 1:
        for r, (numel, layers, has_out) in enumerate(
            zip(layout.pp_rank_numel, layout.pp_rank_layers, layout.pp_rank_has_output)
        ):
            scale = numel / layout.pp_rank_numel[0]
            a = acts(layers, has_out)["total"]
            states = int((param_bytes + grad_bytes + optimizer_bytes) * scale)
            per_pp.append(
                {
                    "pp_rank": r,
                    "params_unsharded": numel,
                    "layers": layers,
                    "has_output": has_out,
                    "state_bytes": states,
                    "activation_bytes": a,
                    "fsdp_buffer_bytes": int(buffers * scale),
                    "total_bytes": int(states + a + buffers * scale),
                }
            )
    worst = max(per_pp, key=lambda d: d["total_bytes"]) if per_pp else None
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_bytes,
        "activation_bytes": act0["total"],
        "fsdp_buffer_bytes": buffers,
        "total_bytes": total0,
        "activation_detail": act0,
        "per_pp_rank": per_pp,
        "most_loaded_pp_rank": worst["pp_rank"] if worst else 0,
        "max_total_bytes": max(worst["total_bytes"], total0) if worst else total0,
    }
