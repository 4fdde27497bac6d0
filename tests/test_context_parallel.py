"""Context parallelism: load-balanced slices, and parity with one process in 2-D to 4-D layouts."""

import pytest
import torch

from lit_titan.strategies.context_parallel import balanced_positions

from helpers import TINY, assert_losses_match, losses

STEPS = 5
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "seed=0", "precision=32-true", "checkpoint.enabled=false"]


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worlds):
    run_dir = tmp_path_factory.mktemp("single")
    worlds.train([*COMMON, "cluster.devices=1"], run_dir)
    return losses(run_dir)


LAYOUTS = {
    "cp2": ["cluster.devices=2", "parallel.cp=2"],
    "cp4": ["cluster.devices=4", "parallel.cp=4"],
    "cp2xdp2": ["cluster.devices=4", "parallel.cp=2", "parallel.dp_shard=2"],
    "cp2xtp2": ["cluster.devices=4", "parallel.cp=2", "parallel.tp=2"],
    "pp2xcp2xtp2": ["cluster.devices=8", "parallel.pp=2", "parallel.cp=2", "parallel.tp=2"],
    "dp2xcp2xpp2": ["cluster.devices=8", "parallel.pp=2", "parallel.cp=2", "parallel.dp_shard=2",
                    "parallel.pp_schedule=Interleaved1F1B"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_matches_single_process(layout, reference, tmp_path, worlds):
    worlds.train([*COMMON, *LAYOUTS[layout]], tmp_path)
    assert_losses_match(losses(tmp_path), reference, rtol=1e-5)
