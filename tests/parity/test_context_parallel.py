"""Context parallelism: load-balanced slices, and parity with one process in 2-D to 4-D layouts."""

import pytest
import torch

from lit_titan.strategies.cp_chunks import balanced_positions
from parity import check_case, run_case


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_balanced_slices_cover_the_sequence_once_with_equal_causal_work(cp):
    seq = 32
    slices = [balanced_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(slices).sort().values, torch.arange(seq))
    # Causal work of a rank = sum over its queries of (position + 1) keys: equal for all ranks.
    work = {int((s + 1).sum()) for s in slices}
    assert len(work) == 1, work
    chunk = seq // (2 * cp)
    assert slices[0][:chunk].tolist() == list(range(chunk))  # head chunk ...
    assert slices[0][chunk:].tolist() == list(range(seq - chunk, seq))  # ... with the matching tail


def test_indivisible_sequence_is_refused():
    with pytest.raises(ValueError, match="data.seq_len"):
        balanced_positions(30, 2, 0)


# Parity with one process (tests/support/parity.py): gradients, the clip norm and weights, so a bug that moves
# attention (RoPE positions, the K/V gather's backward) shows even where the losses barely move.
CASES = ["cp2", "cp4", "cp2xdp2_accum2", "cp2xtp2", "pp2xcp2xtp2", "dp2xcp2xpp2_Interleaved1F1B"]


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_context_parallel_matches_single_process(case, parity_reference, tmp_path, worlds):
    check_case(case, parity_reference, run_case(worlds, case, tmp_path, parity_reference))
