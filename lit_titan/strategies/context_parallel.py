"""Context parallelism: every rank of the ``cp`` group holds a slice of every sequence.

Load balance: a sequence of S tokens is cut into 2*cp chunks; cp rank r holds chunks r and
2*cp-1-r, so under the causal mask every rank does the same attention work.

Attention across slices, three ways (``parallel.cp_mode``):
- ``allgather`` (here; what Llama 3 used at 405B scale): each rank all-gathers K and V and attends
  its local queries to the keys of the whole sequence. Per-rank K/V memory grows with the full sequence.
- ``ulysses`` (``cp_ulysses.py``): an all-to-all turns sequence-sharded Q/K/V into head-sharded
  full sequences, plain attention, and back: K/V per rank is 1/cp of all-gather's.
- ``ring`` (``cp_ring.py``): K/V blocks travel around the cp ranks, partial results merged by their
  log-sum-exp; each rank holds its own K/V block and the one in flight.
Why not torch's experimental ``context_parallel``: it only covers CUDA SDPA kernels (on CPU:
"_scaled_dot_product_flash_attention_for_cpu does not have a sharding strategy registered") and
patches SDPA globally through private APIs; these use public collectives on any backend, so CPU
tests prove the same code that runs on GPUs.

Document masking: the strategy shards the per-token document ids like the tokens; this module's
forward pre-hook wraps them as ``ShardedDocuments``, which the model's ``attention_mask`` passes
through unchanged, so each mode builds the block-causal mask per pair of query/key chunks from the
ids of both (all-gathered once per forward: an int per token).

Nothing here touches the model's code: the strategy swaps the model's core attention modules
(named by the family's ParallelPlan) and injects ``positions`` with a forward pre-hook.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lit_titan.strategies.cp_chunks import (
    ShardedDocuments,
    balanced_positions,
    chunk_blocks,
    documents_of,
    gathered_to_original,
    visible,
)
from lit_titan.strategies.settings import CP_MODES


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` whose backward sums the gradient back to each owner's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group, dim = ctx.group, ctx.dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = [c.contiguous() for c in grad.chunk(world, dim=dim)]
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(chunks[0])
            dist.reduce_scatter(out, chunks, group=group)
        else:  # gloo has no reduce-scatter: all-reduce, keep our slice
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            out = grad.chunk(world, dim=dim)[rank].contiguous()
        return out, None, None


class AllGatherKVAttention(nn.Module):
    """Causal attention of the local query chunks against the all-gathered keys/values.

    Each of the rank's two query chunks (sequence blocks ``r`` and ``2cp-1-r``) attends only to the
    key prefix that ends with its own block, under a lower-right causal bias: no work or memory
    is spent on keys the mask would hide, and SDPA keeps its fused kernels (flash/efficient on
    CUDA; on CPU a plain causal call for a block that starts the sequence, a materialised
    prefix mask otherwise, cached and shared by the layers).
    """

    def __init__(self, group: dist.ProcessGroup, masks: dict | None = None, window: int | None = None) -> None:
        super().__init__()
        self.group = group
        # sliding window (model.sliding_window) of the core this replaces: each query chunk reads only
        # the keys its window reaches (all K/V are still gathered: the other chunk may need them)
        self.window = window
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Reorder index per (seq_len, device): built once, not copied to the device every call.
        self._order: dict[tuple[int, torch.device], Tensor] = {}
        self._masks: dict[tuple, Tensor] = {} if masks is None else masks  # shared by the layers

    def _gathered_order(self, seq_len: int, device: torch.device) -> Tensor:
        key = (seq_len, device)
        if key not in self._order:
            self._order[key] = gathered_to_original(seq_len, self.cp).to(device)
        return self._order[key]

    def _prefix_mask(self, chunk: int, end: int, like: Tensor) -> Tensor | object:
        """Lower-right causal mask of a ``chunk`` of queries over ``end`` keys.

        On CUDA torch's ``causal_lower_right`` bias dispatches to fused kernels without building
        the mask. On CPU SDPA materialises any mask as an additive one in the query dtype and saves
        it for backward, a new one per layer; a cached additive mask per shape is that same tensor,
        shared by all layers (measured: 24 MiB -> 4 MiB per rank at seq 2048, cp2, 6 layers).
        """
        from torch.nn.attention.bias import causal_lower_right

        if like.device.type == "cuda":
            return causal_lower_right(chunk, end)
        key = (chunk, end, like.device, like.dtype)
        if key not in self._masks:
            visible = torch.ones(chunk, end, dtype=torch.bool, device=like.device).tril(end - chunk)
            mask = torch.zeros(chunk, end, dtype=like.dtype, device=like.device)
            self._masks[key] = mask.masked_fill_(~visible, float("-inf"))
        return self._masks[key]

    def _window_mask(self, chunk: int, block: int, start: int, end: int, like: Tensor) -> Tensor:
        """Additive mask of query block ``block`` over keys [start, end): causal and within the window."""
        key = ("window", chunk, block, start, end, self.window, like.device, like.dtype)
        if key not in self._masks:
            qi = torch.arange(block * chunk, (block + 1) * chunk, device=like.device)[:, None]
            kj = torch.arange(start, end, device=like.device)[None, :]
            visible = (kj <= qi) & (qi - kj < self.window)
            mask = torch.zeros(chunk, end - start, dtype=like.dtype, device=like.device)
            self._masks[key] = mask.masked_fill_(~visible, float("-inf"))
        return self._masks[key]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: object = None) -> Tensor:
        # q [b, heads, local_seq, d], k/v [b, kv_heads, local_seq, d]; local_seq holds two chunks.
        # K/V stay at kv_heads width (SDPA's enable_gqa, no repeat): n_rep times fewer bytes on the
        # wire and, since SDPA saves its inputs for backward, in the full-sequence K/V each rank
        # keeps per layer, the one activation that does not shrink with cp.
        docs = documents_of(mask)
        chunk = q.shape[2] // 2
        seq_len = q.shape[2] * self.cp
        order = self._gathered_order(seq_len, q.device)
        gqa = q.shape[1] != k.shape[1]
        k = _AllGatherSeq.apply(k, self.group, 2).index_select(2, order)
        v = _AllGatherSeq.apply(v, self.group, 2).index_select(2, order)
        outs = []
        for q_chunk, block in zip(q.split(chunk, dim=2), chunk_blocks(self.cp, self.rank)):
            end = (block + 1) * chunk
            start = 0 if self.window is None else max(0, block * chunk - (self.window - 1))
            kv = k[:, :, start:end], v[:, :, start:end]
            if docs is not None:  # block-causal: this chunk pair's slice of the document mask
                ids = docs.full()
                same = ids[:, block * chunk : end, None] == ids[:, None, start:end]
                attn_mask = (visible(block * chunk, start, chunk, end - start, self.window, q.device) & same)[:, None]
                outs.append(F.scaled_dot_product_attention(q_chunk, *kv, attn_mask=attn_mask, enable_gqa=gqa))
            elif self.window is not None:
                attn_mask = self._window_mask(chunk, block, start, end, q_chunk)
                outs.append(F.scaled_dot_product_attention(q_chunk, *kv, attn_mask=attn_mask, enable_gqa=gqa))
            elif end == chunk:  # the first block: an ordinary causal square
                outs.append(F.scaled_dot_product_attention(q_chunk, *kv, is_causal=True, enable_gqa=gqa))
            else:
                attn_mask = self._prefix_mask(chunk, end, q_chunk)
                outs.append(F.scaled_dot_product_attention(q_chunk, *kv, attn_mask=attn_mask, enable_gqa=gqa))
        return torch.cat(outs, dim=2)


class ContextParallel:
    """Shards batches along the sequence and wires a model for CP (attention swap + positions).

    ``mode``: ``allgather``, ``ulysses`` or ``ring`` (``parallel.cp_mode``, the module docstring).
    """

    def __init__(self, group: dist.ProcessGroup, mode: str = "allgather") -> None:
        if mode not in CP_MODES:
            raise ValueError(f"parallel.cp_mode={mode}: not an option; choose one of {'|'.join(CP_MODES)}")
        self.group = group
        self.mode = mode
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def shard(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        """This rank's load-balanced slice of each [b, seq, ...] tensor."""
        pos = balanced_positions(tensors[0].shape[1], self.cp, self.rank, tensors[0].device)
        return tuple(t.index_select(1, pos) for t in tensors)

    def core(self, window: int | None, masks: dict) -> nn.Module:
        """The attention module of this mode that replaces one core (sliding ``window`` or None)."""
        if self.mode == "ulysses":
            from lit_titan.strategies.cp_ulysses import UlyssesAttention

            return UlyssesAttention(self.group, window=window)
        if self.mode == "ring":
            from lit_titan.strategies.cp_ring import RingAttention

            return RingAttention(self.group, window=window)
        return AllGatherKVAttention(self.group, masks, window=window)

    def apply(self, model: nn.Module, attention_cores: list[tuple[nn.Module, str]]) -> None:
        masks: dict = {}  # one CPU prefix mask per shape for all layers (see AllGatherKVAttention)
        for parent, name in attention_cores:
            window = getattr(getattr(parent, name), "window", None)
            core = self.core(window, masks)
            # Compiled blocks (callbacks=[compile]) run the CP core eagerly between two graphs: its collectives
            # (all-gather in an autograd Function, all-to-all, ring isend/irecv) and per-step Python are not
            # traceable; transforms.compile_blocks drops fullgraph for this break under CP.
            core.forward = torch.compiler.disable(core.forward)
            setattr(parent, name, core)
        model.register_forward_pre_hook(self._inject_positions, with_kwargs=True)

    def _inject_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """positions: the balanced slice's (or the given, already sharded, document positions);
        documents: wrapped as ``ShardedDocuments`` for the CP attention."""
        # The model's signature is forward(tokens, positions=None, labels=None, documents=None).
        kwargs = {**dict(zip(("positions", "labels", "documents"), args[1:])), **kwargs}
        local = args[0].shape[1]
        device = args[0].device if not hasattr(args[0], "to_local") else args[0].to_local().device
        if kwargs.get("positions") is None:
            kwargs["positions"] = balanced_positions(local * self.cp, self.cp, self.rank, device)
        if isinstance(kwargs.get("documents"), Tensor):
            kwargs["documents"] = ShardedDocuments(kwargs["documents"], self.group)
        return args[:1], kwargs
