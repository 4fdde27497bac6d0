"""``fault_tolerance.enabled=true`` is refused in one line where replica-group fault tolerance cannot run (yet)."""

from __future__ import annotations

import pytest

from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError

FT = ["fault_tolerance.enabled=true"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["cluster.devices=4"], "fault_tolerance.enabled=true: parallel.dp_replicate=1, there is no other replica"),
        (["cluster.devices=4", "parallel.dp_replicate=2", "parallel.tp=2"], "parallel.tp=2: fault_tolerance"),
        (["cluster.devices=4", "parallel.dp_replicate=2", "parallel.cp=2"], "parallel.cp=2: fault_tolerance"),
        (
            ["cluster.devices=4", "parallel.dp_replicate=2", "trainer.limit_val_batches=2"],
            "trainer.limit_val_batches=2",
        ),
        (["fault_tolerance.dead_after_s=0"], "fault_tolerance.dead_after_s"),
    ],
)
def test_fault_tolerance_is_refused_where_it_cannot_run(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("*", r"\*")):
        validate(compose([*FT, *overrides]))


@pytest.mark.parametrize(
    "layout", [["data.micro_batch_size=1"], ["parallel.pp=2", "data.micro_batch_size=2"]], ids=["hsdp", "pp"]
)
def test_hsdp_with_fault_tolerance_is_accepted_with_one_lightning_batch_per_step(layout):
    from lit_titan.job.build import trainer_arguments

    cfg = compose([*FT, "cluster.devices=4", "parallel.dp_replicate=2", *layout])
    spec = validate(cfg)
    assert spec.batch.accumulation > 1 and trainer_arguments(cfg, spec)["accumulate_grad_batches"] == 1
