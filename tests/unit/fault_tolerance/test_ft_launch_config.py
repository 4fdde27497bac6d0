"""One launch per replica group (``fault_tolerance.replica_id`` / ``store``): bad input is one line, before any work.

The launch itself (two torchrun agents, one group killed and restarted alone) is
tests/commands/test_ft_launch.py; here the config rules and the check of what the launcher started.
"""

from __future__ import annotations

import pytest

from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError
from lit_titan.fault_tolerance.launch import check_launch, job_rank, store_address

JOB = ["cluster.devices=2", "cluster.num_nodes=2", "parallel.dp_replicate=2"]
FT = [*JOB, "fault_tolerance.enabled=true"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ([*JOB, "fault_tolerance.replica_id=1"], "fault_tolerance.replica_id=1: launches one replica group"),
        ([*FT, "fault_tolerance.replica_id=2", "fault_tolerance.store=h:1"], "replica_id=2: the job has parallel"),
        ([*FT, "fault_tolerance.replica_id=1"], "replica_id=1: every replica group's launch must meet in one store"),
        ([*FT, "fault_tolerance.store=node0"], "fault_tolerance.store=node0: not HOST:PORT"),
    ],
)
def test_a_replica_group_launch_is_refused_in_one_line_before_any_work(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("*", r"\*")) as err:
        validate(compose(overrides))
    assert "\n" not in str(err.value)


def test_a_replica_group_launch_is_accepted():
    validate(compose([*FT, "fault_tolerance.replica_id=1", "fault_tolerance.store=node0:29600"]))


def test_the_launch_must_hold_the_whole_job_or_one_group():
    """torchrun's WORLD_SIZE against the job (4) and a group (2): one line naming what to set."""
    check_launch(None, 4, 4, 2)  # one launch for the job
    check_launch(1, 2, 4, 2)  # one launch per group
    check_launch(None, None, 4, 2)  # not started by a launcher that says
    for replica, launched, needle in [
        (None, 2, "fault_tolerance.replica_id=null: this launch started 2 of the job's 4 processes"),
        (1, 4, "fault_tolerance.replica_id=1: this launch started all 4 processes"),
        (0, 3, "this launch started 3 processes, but the job has 4"),
    ]:
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            check_launch(replica, launched, 4, 2)


def test_job_rank_and_store_of_a_group_launch(monkeypatch):
    assert [job_rank(r, 2, 1) for r in (0, 1)] == [2, 3]  # group 1's torchrun numbers its ranks 0, 1
    assert [job_rank(r, 2, None) for r in range(4)] == [0, 1, 2, 3]
    monkeypatch.setenv("MASTER_ADDR", "agent")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert store_address("store.host:29600") == ("store.host", 29600)
    assert store_address(None) == ("agent", 29500)


def test_launch_prints_the_store_and_one_torchrun_per_replica_group():
    """The lines tests/commands/test_ft_launch.py runs; groups of several nodes meet at their first node."""
    from lit_titan.cli.launch import launch_command

    overrides = ["cluster=cpu", "cluster.num_nodes=4", "cluster.devices=2", "parallel.dp_replicate=2", *FT[3:]]
    text = launch_command(compose(overrides), [*overrides, "run_dir=/shared/a"])
    store, agent = [line for line in text.splitlines() if not line.startswith("#")]
    assert store == "python -m lit_titan.cli store --port 29600"
    assert agent.startswith("torchrun --nnodes=2 --nproc_per_node=2 --max-restarts=3 --rdzv_backend=c10d ")
    assert '--rdzv_endpoint="${GROUP_ADDR:?' in agent and '--rdzv_id="lit-titan-group$REPLICA"' in agent
    assert '"fault_tolerance.replica_id=${REPLICA:?' in agent and '"fault_tolerance.store=${LIT_TITAN_STORE:?' in agent
    assert "resume=" not in agent  # a restarted group takes a live peer's state, not a checkpoint
    for bad, needle in [
        (["cluster.num_nodes=3", "parallel.dp_shard=3"], "cluster.num_nodes=3: one torchrun per replica group"),
        (["fault_tolerance.store=h:1"], "fault_tolerance.store=h:1: each group's line sets it"),
    ]:
        wrong = [*FT, "cluster=cpu", "cluster.devices=2", *bad]
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            launch_command(compose(wrong), wrong)
