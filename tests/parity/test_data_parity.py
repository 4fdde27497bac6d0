"""Training on the one global order: the same losses for any layout, accumulation and workers.

The reference is one process taking the whole global batch of 16 in one micro-batch; the
others split it over ranks, micro-batches and loader workers: the order does not depend on the
layout, so a layout with accumulation compares with one process of any micro-batch.
"""

import pytest

from helpers import TINY, assert_losses_match, losses, read_metrics

pytestmark = pytest.mark.slow

STEPS = 10
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "seed=0", "precision=32-true", "data.global_batch_size=16"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, worlds):
    run_dir = tmp_path_factory.mktemp("one_process_micro16")
    worlds.train([*COMMON, "cluster.devices=1"], run_dir)
    return run_dir


@pytest.mark.parametrize("layout", [
    ["cluster.devices=2", "data.micro_batch_size=2"],  # dp2 x micro 2 x accumulation 4
    ["cluster.devices=4", "data.num_workers=2"],  # dp4, two loader workers per rank
], ids=["dp2_micro2_accum4", "dp4_workers2"])
@pytest.mark.parity
def test_losses_match_one_process(one_process, layout, tmp_path, worlds):
    worlds.train([*COMMON, *layout], tmp_path)
    ref = losses(one_process)
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert_losses_match(losses(tmp_path), ref, rtol=1e-5)
    # tokens per source in metrics.csv: the global count, whatever the layout
    last = read_metrics(tmp_path)[-1]
    tokens = [float(v) for k, v in last.items() if k.startswith("data/tokens/") and v]
    assert tokens == [STEPS * 16 * 32]
