"""Training on the one global order: the same gradients for any layout, accumulation and workers.

The reference is the session's one-process run (tests/support/parity.py, ``parity_reference``): the whole
global batch of 8 in one micro-batch. The cases split it over ranks, micro-batches and loader workers
and must match it in pre-clip gradients, the clip norm, weights and losses (``parity.check_case``:
lr 1e-2, clipping engaged, ``parity.TOL``).
"""

import pytest

from helpers import read_metrics
from parity import STEPS, check_case, run_layout

pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN = 8, 32  # parity.PARITY's (helpers.TINY)


@pytest.mark.parametrize(
    "layout",
    [
        ["cluster.devices=2", "data.micro_batch_size=1"],  # dp2 x micro 1 x accumulation 4
        ["cluster.devices=4", "data.num_workers=2"],  # dp4, two loader workers per rank
    ],
    ids=["dp2_micro1_accum4", "dp4_workers2"],
)
@pytest.mark.parity
def test_layout_matches_one_process(parity_reference, layout, tmp_path, worlds):
    check_case("data:" + "_".join(layout), parity_reference, run_layout(worlds, layout, tmp_path))
    # tokens per source in metrics.csv: the global count, whatever the layout
    last = read_metrics(tmp_path)[-1]
    tokens = [float(v) for k, v in last.items() if k.startswith("data/tokens/") and v]
    assert tokens == [STEPS * GLOBAL_BATCH * SEQ_LEN]
