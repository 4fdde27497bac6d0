"""One rank's attention work under each context-parallel mode, on one device: tokens/s and peak memory.

Context parallelism needs cp > 1 devices to run for real; what one GPU can show is the *kernel* each mode runs
on a rank, without the communication (the collectives are replaced by the tensors they would deliver):

- ``sdpa``: causal SDPA over the whole sequence, one device, no CP (the baseline);
- ``allgather``: rank 0's two query chunks (of 2cp) against the key prefix each can see, SDPA with a
  lower-right causal bias (what ``AllGatherKVAttention`` runs after its all-gather);
- ``ulysses``: causal SDPA over the whole sequence for ``heads/cp`` of the heads (after the all-to-all);
- ``ring``: rank 0's two query chunks against all 2cp key chunks, chunk pair by chunk pair, with the ring's own
  per-block kernel and log-sum-exp merge (``lit_titan.strategies.cp_ring``: ``pair_mask``, ``_block_forward``,
  ``merge``, ``_block_backward``), forward and the flash-style backward; the chunk pairs causality hides are
  skipped as in the ring.

Each row: forward + backward of one layer's attention (the time per call after warm-up), the tokens that rank
owns per second, and the peak memory the call allocates (CUDA only). Llama 3 8B's attention shapes by default
(32 heads, 8 KV heads, head_dim 128), bf16 on CUDA.

    python benchmarks/cp_kernels.py --seq-len 32768 65536 131072 --cp 2 4 8      # on one GPU
    python benchmarks/cp_kernels.py --cpu-smoke                                   # plumbing check, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from lit_titan.strategies.cp_chunks import chunk_blocks
from lit_titan.strategies.cp_ring import _block_backward, _block_forward, _grouped, merge, pair_mask

MODES = ("sdpa", "allgather", "ulysses", "ring")


def ring_rank_attention(q, k, v, cp: int) -> tuple[torch.Tensor, callable]:
    """Rank 0's share of ring attention over the whole sequence's K/V ``k, v`` [b, kv_heads, seq, d], with its
    query chunks ``q`` [b, heads, 2*chunk, d]; returns the output and a backward closure (dq, dk, dv).

    The same per-block kernel, merge and skipping as ``cp_ring._RingAttention``; the K/V chunks the ring would
    deliver are sliced from ``k, v`` instead."""
    b, h, s2, d = q.shape
    g, chunk, scale = k.shape[1], s2 // 2, 1.0 / math.sqrt(d)
    qf = _grouped(q, g)
    kf, vf = k.to(qf.dtype), v.to(qf.dtype)
    out = torch.zeros_like(qf)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=qf.dtype, device=q.device)
    pairs = []
    for i, qb in enumerate(chunk_blocks(cp, 0)):
        rows = slice(i * chunk, (i + 1) * chunk)
        for kb in range(2 * cp):
            mask = pair_mask(qb, kb, chunk, None, None, q.device)
            if mask is False:
                continue
            cols = slice(kb * chunk, (kb + 1) * chunk)
            pairs.append((rows, cols, mask))
            part, part_lse = _block_forward(qf[..., rows, :], kf[:, :, cols], vf[:, :, cols], mask, scale)
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], part, part_lse)
    result = out.reshape(b, h, s2, d).to(q.dtype)

    def backward(grad: torch.Tensor):
        do = _grouped(grad, g)
        delta = (do * _grouped(result, g)).sum(-1)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        for rows, cols, mask in pairs:
            dqi, dkj, dvj = _block_backward(
                qf[..., rows, :], kf[:, :, cols], vf[:, :, cols], do[..., rows, :], lse[..., rows], delta[..., rows],
                mask, scale,
            )  # fmt: skip
            dq[..., rows, :] += dqi
            dk[:, :, cols] += dkj
            dv[:, :, cols] += dvj
        return dq.reshape(b, h, s2, d), dk, dv

    return result, backward


def _prefix_bias(chunk: int, end: int, like: torch.Tensor):
    if like.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(chunk, end)
    seen = torch.ones(chunk, end, dtype=torch.bool, device=like.device).tril(end - chunk)
    return torch.zeros(chunk, end, dtype=like.dtype, device=like.device).masked_fill_(~seen, float("-inf"))


def run_mode(mode: str, *, seq: int, cp: int, heads: int, kv_heads: int, head_dim: int, dtype, device) -> None:
    """One forward + backward of ``mode``'s per-rank attention (tensors made here, freed on return)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype, requires_grad=True)

    chunk = seq // (2 * cp)
    if mode in ("sdpa", "ulysses"):
        h, hk = (heads, kv_heads) if mode == "sdpa" else (heads // cp, kv_heads // cp)
        q, k, v = rnd(1, h, seq, head_dim), rnd(1, hk, seq, head_dim), rnd(1, hk, seq, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != hk)
        out.backward(torch.ones_like(out))
        return
    k, v = rnd(1, kv_heads, seq, head_dim), rnd(1, kv_heads, seq, head_dim)
    q = rnd(1, heads, 2 * chunk, head_dim)
    if mode == "allgather":
        outs = []
        for i, block in enumerate(chunk_blocks(cp, 0)):
            end = (block + 1) * chunk
            qc = q[:, :, i * chunk : (i + 1) * chunk]
            if end == chunk:
                outs.append(
                    F.scaled_dot_product_attention(qc, k[:, :, :end], v[:, :, :end], is_causal=True, enable_gqa=True)
                )
            else:
                bias = _prefix_bias(chunk, end, qc)
                outs.append(
                    F.scaled_dot_product_attention(qc, k[:, :, :end], v[:, :, :end], attn_mask=bias, enable_gqa=True)
                )
        out = torch.cat(outs, dim=2)
        out.backward(torch.ones_like(out))
        return
    with torch.no_grad():
        out, backward = ring_rank_attention(q, k, v, cp)
        backward(torch.ones_like(out))


def rank0_outputs_match(*, seq: int, cp: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """Largest difference of the ring kernel's rank-0 output (and its dq) from the rows of plain causal SDPA over
    the whole sequence (fp64, CPU): the emulation runs the real kernel, not an approximation of it."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, seq, head_dim, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, dtype=torch.float64, generator=gen) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn(ref.shape, dtype=ref.dtype, generator=gen)
    (ref * grad).sum().backward()
    chunk = seq // (2 * cp)
    rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_blocks(cp, 0)])
    out, backward = ring_rank_attention(q.detach()[:, :, rows], k, v, cp)
    dq = backward(grad[:, :, rows])[0]
    return max((out - ref.detach()[:, :, rows]).abs().max().item(), (dq - q.grad[:, :, rows]).abs().max().item())


def measure(mode: str, *, reps: int, warmup: int, **kw) -> dict:
    device = kw["device"]
    cuda = device.type == "cuda"
    for _ in range(warmup):
        run_mode(mode, **kw)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(reps):
        run_mode(mode, **kw)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / reps
    tokens = kw["seq"] if mode == "sdpa" else kw["seq"] // kw["cp"]  # the tokens this rank owns
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"mode": mode, "seq_len": kw["seq"], "cp": kw["cp"], "ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
            "peak_mib": peak}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, fp32: the plumbing, not a figure")
    p.add_argument("--json", default="", help="also write the rows to this file")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        a.seq_len, a.cp, a.heads, a.kv_heads, a.head_dim, a.reps, a.warmup = [256], [2], 4, 2, 16, 1, 0
    else:
        if not torch.cuda.is_available():
            raise SystemExit("cp_kernels: no CUDA device; run with --cpu-smoke for the CPU plumbing check")
        device, dtype = torch.device("cuda"), torch.bfloat16
    if a.cpu_smoke:
        err = rank0_outputs_match(seq=a.seq_len[0], cp=a.cp[0], heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim)
        print(f"ring kernel, rank 0 of cp{a.cp[0]} against whole-sequence SDPA (fp64): max difference {err:.3g}")
    rows = []
    print("| mode | cp | seq_len | ms per fwd+bwd (one layer, one rank) | rank's tokens/s | peak MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for seq in a.seq_len:
        for cp in a.cp:
            for mode in a.mode:
                if mode == "sdpa" and cp != a.cp[0]:
                    continue  # no CP: the same row for every cp
                kw = dict(seq=seq, cp=cp, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=dtype,
                          device=device)  # fmt: skip
                try:
                    r = measure(mode, reps=a.reps, warmup=a.warmup, **kw)
                except torch.OutOfMemoryError:
                    r = {"mode": mode, "seq_len": seq, "cp": cp, "ms": None, "tokens_per_s": None, "peak_mib": None,
                         "error": "out of memory"}  # fmt: skip
                    torch.cuda.empty_cache()
                rows.append(r)
                shown_cp = 1 if mode == "sdpa" else cp
                if r["ms"] is None:
                    print(f"| {mode} | {shown_cp} | {seq} | out of memory | - | - |")
                    continue
                peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
                print(f"| {mode} | {shown_cp} | {seq} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {peak} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
