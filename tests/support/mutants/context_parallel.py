"""Mutants of the context-parallel modes (parallel.cp_mode=ulysses|ring); registered on import by mutants/__init__.py."""

from __future__ import annotations

from mutants import _Patcher, mutant


@mutant(
    "cp_ring_merge_without_lse_rescale",
    "the ring adds each step's partial attention to the running output without rescaling either by the log-sum-exp",
    "strategies/cp_ring.py: merge",
)
def _ring_merge(p: _Patcher) -> None:
    import torch

    from lit_titan.strategies import cp_ring

    p.set(cp_ring, "merge", lambda out, lse, block_out, block_lse: (out + block_out, torch.logaddexp(lse, block_lse)))


@mutant(
    "cp_ulysses_all_to_all_wrong_dim",
    "Ulysses' all-to-all scatters the head dimension (the last) instead of the heads",
    "strategies/cp_ulysses.py: seq_to_heads / heads_to_seq",
)
def _ulysses_dim(p: _Patcher) -> None:
    from lit_titan.strategies import cp_ulysses

    p.set(cp_ulysses, "seq_to_heads", lambda x, group: cp_ulysses._AllToAll.apply(x, group, 3, 2))
    p.set(cp_ulysses, "heads_to_seq", lambda x, group: cp_ulysses._AllToAll.apply(x, group, 2, 3))


@mutant(
    "cp_ring_chunk_mask_off_by_one",
    "the ring's causal mask of a chunk pair takes the key chunk for the one before it",
    "strategies/cp_ring.py: chunk_causality",
)
def _ring_off_by_one(p: _Patcher) -> None:
    from lit_titan.strategies import cp_ring

    original = cp_ring.chunk_causality
    p.set(
        cp_ring,
        "chunk_causality",
        lambda q_block, k_block, chunk, window, device: original(q_block, k_block - 1, chunk, window, device),
    )


@mutant(
    "cp_document_boundary_across_chunk",
    "the ring applies the document mask only within a chunk: a boundary before the chunk's edge is ignored",
    "strategies/cp_ring.py: pair_documents",
)
def _ring_documents(p: _Patcher) -> None:
    from lit_titan.strategies import cp_ring

    original = cp_ring.pair_documents
    p.set(
        cp_ring,
        "pair_documents",
        lambda q_block, k_block, chunk, ids: original(q_block, k_block, chunk, ids) if q_block == k_block else None,
    )
