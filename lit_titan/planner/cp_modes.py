"""What each context-parallel mode (``parallel.cp_mode``) costs a rank: memory, communication, overlap.

The three modes (lit_titan/strategies/context_parallel.py, cp_ulysses.py, cp_ring.py) compute the same
attention and the same *model* FLOPs (MFU counts the model's, lit_titan/models/llama3/flops.py, never the
kernel's: ring skipping the chunk pairs causality hides changes neither), but differ in what a rank keeps
and sends per transformer block. Per block and micro-batch of ``b`` sequences of ``s`` tokens, tp ``t``,
cp ``c``, K/V width ``h_kv = n_kv_heads * head_dim``, query width ``h = n_heads * head_dim``:

- memory kept for backward beyond the local slice (the per-block formulas of estimate.py count the local
  Q/K/V/output already):
  allgather: the rest of the full sequence's K/V, ``2 * s*b*2h_kv/t * (1 - 1/c)`` bytes (16-bit);
  ulysses: nothing (attention keeps the whole sequence for h/c of the heads: the local slice's bytes);
  ring: nothing kept, but a transient in each block's backward: the K/V block in flight and the fp32
  gradient accumulators of K/V (the rank's and the one in flight), ``s*b/(t*c)*2h_kv * (act + 2*4)`` bytes;
- communication per rank, forward + backward (bf16 activations, fp32 ring gradients):
  allgather: all-gather of K/V forward, reduce-scatter of their gradients backward,
  ``2 * (c-1)/c * s*b*2h_kv/t * 2`` bytes; exposed (the attention waits for it);
  ulysses: 4 all-to-alls forward (Q, K, V, output) and 4 backward, each moving (c-1)/c of a local tensor,
  ``2 * (c-1)/c * s*b/c*(2h + 2h_kv)/t * 2`` bytes; exposed;
  ring: c-1 K/V block sends forward, c-1 backward plus c sends of the fp32 K/V gradients,
  ``(c-1) * 2 * B + c * 4 * B`` with ``B = s*b/(t*c)*2h_kv`` elements; overlapped with the attention of the
  same block (each step's send runs while the current block computes), so only what exceeds that
  attention's kernel time is exposed.

Ring's per-block kernel as shipped (cp_ring.py: ``_block_forward``/``_block_backward``) is fp32 math, not a
fused kernel, and the plan says what that costs: each chunk pair's scores exist whole while it computes
(``RING_SCORE_TENSORS`` fp32 tensors of ``[b, n_heads/t, chunk, chunk]``, chunk = s/(2c): scores, probabilities
and, in backward, their gradient), and its attention matmuls run at the fp32 peak (``peak_fp32_tflops``, else
the bf16 peak / ``FP32_MATH_SLOWDOWN``) unless training is fp32 anyway. A fused per-block kernel with a
log-sum-exp output would remove both; these constants are where the plan would follow it.

Ulysses needs n_heads and n_kv_heads divisible by tp x cp (config/rules.py: ``cp_mode_fits_model``).
"""

from __future__ import annotations

from typing import Any

from lit_titan.strategies.settings import CP_MODES

# bytes per element on the wire: activations in bf16 (as the TP/FSDP terms of estimate.py), ring's K/V
# gradient accumulators in fp32 (cp_ring.py: _compute_dtype)
WIRE_ELEM = 2
RING_GRAD_ELEM = 4
OVERLAPPED = {"allgather": False, "ulysses": False, "ring": True}
RING_SCORE_TENSORS = 3
# dense BF16 tensor-core peak / FP32 peak of an H100 SXM (989 / 67 TFLOP/s, NVIDIA datasheet): ring's einsums
# in fp32 (torch's default matmul precision: no TF32) against the flash kernels the other modes call
FP32_MATH_SLOWDOWN = 989 / 67


def ulysses_fits(args, tp: int, cp: int) -> bool:
    """Ulysses splits the heads (and KV heads) of each TP shard over cp."""
    return args.n_heads % (tp * cp) == 0 and args.kv_heads % (tp * cp) == 0


def modes_for(args, tp: int, cp: int) -> tuple[str, ...]:
    """The modes a layout can run (cp == 1: none matters, the default stands for all)."""
    if cp == 1:
        return ("allgather",)
    return tuple(m for m in CP_MODES if m != "ulysses" or ulysses_fits(args, tp, cp))


def kept_kv_bytes(args, s: int, b: int, t: int, cp: int, mode: str) -> float:
    """16-bit count of what one block keeps for backward beyond its local slice (allgather: gathered K/V)."""
    if cp == 1 or mode != "allgather":
        return 0.0
    return s * b / t * 4 * args.kv_heads * args.head_dim * (1 - 1 / cp)


def backward_transient_bytes(args, s: int, b: int, t: int, cp: int, mode: str, act_elem: int) -> float:
    """Bytes alive only inside one block's backward: ring's K/V block in flight, its two fp32 gradient
    accumulators (the rank's own and the one travelling) and one chunk pair's fp32 scores (the shipped
    kernel, module docstring); nothing extra for the others."""
    if cp == 1 or mode != "ring":
        return 0.0
    block = s * b / (t * cp) * 2 * args.kv_heads * args.head_dim  # elements of the local K and V
    chunk = s / (2 * cp)
    scores = RING_SCORE_TENSORS * b * args.n_heads / t * chunk * chunk * 4
    return block * (act_elem + 2 * RING_GRAD_ELEM) + scores


def comm_bytes_per_block(args, s: int, b: int, t: int, cp: int, mode: str) -> float:
    """Bytes one rank sends per block and micro-batch, forward + backward."""
    if cp == 1:
        return 0.0
    h, h_kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    part = (cp - 1) / cp
    if mode == "allgather":
        return 2 * part * s * b * 2 * h_kv / t * WIRE_ELEM
    if mode == "ulysses":
        return 2 * part * s * b / cp * (2 * h + 2 * h_kv) / t * WIRE_ELEM
    if mode == "ring":
        block = s * b / (t * cp) * 2 * h_kv
        return (cp - 1) * 2 * block * WIRE_ELEM + cp * block * RING_GRAD_ELEM
    raise ValueError(f"parallel.cp_mode={mode}: not an option; choose one of {'|'.join(CP_MODES)}")


def attention_kernel_flops(args, s: int, b: int, t: int, cp: int, layer: int) -> float:
    """FLOPs one rank's attention kernel runs per block and micro-batch (forward + backward): the keys a
    causal (windowed) query really reads, ``w - w^2/(2s)`` on average for a window ``w <= s`` (``s/2``
    without one). What ring's transfers can hide behind; not what MFU counts."""
    w = min(args.window_of(layer) or s, s)
    keys = w - w * w / (2 * s)
    return 12 * args.n_heads / t * args.head_dim * keys * s * b / cp


def ring_kernel_rate(cluster: dict[str, Any], precision: str, flops_per_s: float, efficiency: float) -> float:
    """FLOP/s of ring's fp32 per-block math: the fp32 peak x efficiency, unless training is fp32 already
    (then the rate every matmul gets, ``flops_per_s``)."""
    if str(precision).startswith("32"):
        return flops_per_s
    fp32 = float(cluster.get("peak_fp32_tflops") or 0) * 1e12 or float(cluster.get("peak_bf16_tflops") or 0) * 1e12 / (
        FP32_MATH_SLOWDOWN
    )
    return min(fp32 * efficiency, flops_per_s)


def cp_time(
    args,
    *,
    s: int,
    b: int,
    t: int,
    cp: int,
    mode: str,
    layers: int,
    bandwidth: float,
    flops_per_s: float,
    kernel_flops_per_s: float | None = None,
) -> dict[str, Any]:
    """Per-step CP cost of ``layers`` blocks at ``b`` sequences per step on this rank: communication seconds,
    the exposed part (ring: beyond its blocks' attention time), the volume per block, and ``kernel_s``, the
    extra time of ring's fp32 kernel over the model's attention FLOPs at ``flops_per_s`` (``kernel_flops_per_s``:
    its own rate, :func:`ring_kernel_rate`)."""
    out = {"mode": mode, "comm_s": 0.0, "exposed_s": 0.0, "kernel_s": 0.0, "bytes_per_block": 0.0}
    if cp == 1:
        return {**out, "overlapped": False}
    volume = comm_bytes_per_block(args, s, b, t, cp, mode)
    comm_s = layers * volume / bandwidth
    exposed, kernel_s = comm_s, 0.0
    if OVERLAPPED[mode]:
        flops = sum(attention_kernel_flops(args, s, b, t, cp, k) for k in range(layers))
        rate = kernel_flops_per_s or flops_per_s
        attention_s = flops / rate
        kernel_s = max(attention_s - flops / flops_per_s, 0.0)
        exposed = max(comm_s - attention_s, 0.0)
    return {
        **out,
        "comm_s": comm_s,
        "exposed_s": exposed,
        "kernel_s": kernel_s,
        "bytes_per_block": volume,
        "overlapped": OVERLAPPED[mode],
    }


def summary(args, *, s: int, b: int, t: int, cp: int, mode: str, act_elem: int) -> dict[str, Any]:
    """plan.json's ``context_parallel``: per block and micro-batch, what the mode keeps, holds and sends."""
    return {
        "mode": mode,
        "kept_kv_bytes_per_block": int(kept_kv_bytes(args, s, b, t, cp, mode) * act_elem / 2),
        "backward_transient_bytes": int(backward_transient_bytes(args, s, b, t, cp, mode, act_elem)),
        "comm_bytes_per_block": int(comm_bytes_per_block(args, s, b, t, cp, mode)),
        "overlapped": OVERLAPPED.get(mode, False) if cp > 1 else False,
    }
