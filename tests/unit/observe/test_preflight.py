"""Pre-flight diagnostics: the slowed rank is named in one line; action=stop exits 2 before anything is written."""

import json
import sys

import pytest

from helpers import TINY, read_metrics, run_job
from lit_titan.config import compose, validate
from lit_titan.errors import ConfigError
from lit_titan.observe.diagnostics import best_of, judge


def _record(rank, tflops, gbps=1.0, ranks=(0, 1)):
    return {
        "rank": rank,
        "host": "h",
        "tflops": tflops,
        "links": {"dp_shard": {"ranks": list(ranks), "all_reduce_gbps": gbps, "all_gather_gbps": gbps}},
    }


def test_judge_names_the_slow_rank_and_the_slow_group():
    records = [
        _record(0, 1.0, 10, (0, 1)),
        _record(1, 1.1, 10, (0, 1)),
        _record(2, 0.3, 10, (2, 3)),
        _record(3, 0.9, 10, (2, 3)),
        _record(4, 1.0, 2, (4, 5)),
        _record(5, 1.0, 2, (4, 5)),
    ]
    found, medians = judge(records, threshold=0.5)
    assert medians["tflops"] == 1.0
    assert found == [
        "rank 2 (h) matmul 0.3 TFLOP/s vs median 1",
        "dp_shard group [4, 5] all_reduce 2 GB/s vs median 10",
        "dp_shard group [4, 5] all_gather 2 GB/s vs median 10",
    ]
    assert judge(records[:2], threshold=0.5)[0] == []


def test_a_slow_figure_must_hold_in_every_round():
    """Two groups per dim: the median is the mean of the two, so one noisy timing (3x off) can flag a healthy
    group. Re-measuring keeps each figure's best; a noisy group recovers, a faulty one stays slow."""
    healthy = [
        _record(0, 1.0, 10, (0, 1)),
        _record(1, 1.0, 10, (0, 1)),
        _record(2, 1.0, 10, (2, 3)),
        _record(3, 1.0, 10, (2, 3)),
    ]
    noisy = [
        _record(0, 1.0, 10, (0, 1)),
        _record(1, 1.0, 10, (0, 1)),
        _record(2, 0.3, 2, (2, 3)),
        _record(3, 1.0, 10, (2, 3)),
    ]
    assert len(judge(noisy, 0.5)[0]) == 3  # one round alone names rank 2 and its group
    assert judge(best_of(noisy, healthy), 0.5)[0] == []
    assert len(judge(best_of(noisy, noisy), 0.5)[0]) == 3  # slow again: still named


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            ["preflight.enabled=true", "preflight.action=abort"],
            "preflight.action=abort: not an option; choose one of warn, stop",
        ),
        (["fault.slow_rank=1"], "fault.slow_rank slows a rank's pre-flight burn-in; set preflight.enabled=true"),
        (["preflight.enabled=true", "fault.slow_rank=7", "cluster.devices=2"], "fault.slow_rank=7: is not a rank"),
        (["preflight.enabled=true", "fault.slow_rank=1", "fault.slow_link=nic"], "fault.slow_link=nic: not an option"),
        (
            ["preflight.enabled=true", "fault.slow_link=inter_node"],
            "fault.slow_link=inter_node: slows a rank's links; set fault.slow_rank=RANK",
        ),
    ],
)
def test_bad_settings_one_line(extra, needle):
    with pytest.raises(ConfigError) as info:
        validate(compose([*TINY, *extra]))
    assert needle in str(info.value) and "\n" not in str(info.value)


RUN = [
    *TINY,
    "trainer.max_steps=2",
    "cluster.devices=4",
    "preflight.enabled=true",
    "fault.slow_rank=2",
    "fault.slow_factor=8",
]


@pytest.mark.slow
def test_warn_names_the_slow_rank_and_trains(tmp_path, worlds):
    worlds.train([*RUN, "preflight.action=warn"], tmp_path)
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    assert any(f.startswith("rank 2 (") for f in report["found"]), report["found"]
    assert all(r["links"]["dp_shard"]["all_reduce_gbps"] > 0 for r in report["ranks"])
    assert report["seconds"] < 60
    assert len(read_metrics(tmp_path)) > 0  # warn: training went on
    from lit_titan.report import make_report

    page = make_report(tmp_path).read_text()  # the run report shows the verdict
    assert "<b>Pre-flight</b>" in page and "rank 2 (node 0, " in page
    assert "intra_node [0, 1, 2, 3]" in page  # one node: its group is the four ranks (no inter-node group)
    assert [sorted(r["links"]) for r in report["ranks"]] == [["dp_shard", "intra_node"]] * 4


@pytest.mark.slow
def test_stop_ends_the_job_before_checkpoints_or_metrics(tmp_path, worlds):
    """action=stop: every rank raises the one-line verdict (the command turns it into exit code 2:
    test_lit_titan_preflight_command) before a metrics file or a checkpoint exists."""
    got = worlds.run(
        4, "scripts.preflight_stop:main", [*RUN, "preflight.action=stop", f"run_dir={tmp_path}"], timeout=300
    ).value
    line = got["stopped"]
    assert line is not None and "\n" not in line, got
    assert line.startswith("preflight:") and "rank 2 (" in line and "preflight.action=stop" in line, line
    assert (tmp_path / "preflight.json").is_file()
    assert not (tmp_path / "metrics.csv").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_lit_titan_preflight_command(tmp_path):
    """`lit-titan preflight`: diagnostics only, action=stop by default: exit 2 naming the slowed rank, nothing else."""
    # Two ranks: the median is the mean of the two, so the slowed rank is named only while the other
    # measures above 3 / slow_factor of its speed. A CI run whose machine was starved (load average
    # 170-390) missed it at 8; 32 keeps the verdict unless the healthy rank is ~10x off.
    proc = run_job(
        [
            sys.executable,
            "-m",
            "lit_titan.cli",
            "preflight",
            *TINY,
            "cluster.devices=2",
            "fault.slow_rank=1",
            "fault.slow_factor=32",
            f"run_dir={tmp_path}",
        ],
        timeout=300,
    )
    assert proc.returncode == 2 and "rank 1 (" in proc.stderr, proc.stderr[-3000:]
    assert json.loads((tmp_path / "preflight.json").read_text())["action"] == "stop"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hydra",
        "config.yaml",
        "preflight.json",
    ]  # no metrics, no checkpoints


@pytest.mark.slow
def test_two_nodes_intra_and_inter_node_groups(tmp_path, worlds):
    """4 ranks as 2 nodes x 2 (node-major): an intra-node group per node, an inter-node group per local rank.

    Rank 3's link to the other node is slowed: only the inter-node group [1, 3] is named, not its node's
    group or its matmul. (A slow rank named with its node: test_warn_names_the_slow_rank_and_trains.)

    "Nothing else named" needs a margin against noise: a CI run on a starved machine (4 ranks on 2 cores)
    saw rank 3's matmul at 0.42 x the median and one intra-node group at 0.49 x in all three rounds, so
    at threshold 0.5 they were named too. Here the drilled link is 64 x slow (about 1/32 of its
    median: the median of two groups is their mean) and the threshold 0.15, so a healthy figure is
    named only if it is ~7 x off in its best of three rounds."""
    drill = ["fault.slow_rank=3", "fault.slow_link=inter_node", "fault.slow_factor=64", "preflight.threshold=0.15"]
    named = ["inter_node group [1, 3] (nodes 0, 1) all_reduce", "inter_node group [1, 3] (nodes 0, 1) all_gather"]
    got = worlds.run(4, "scripts.preflight_nodes:main", [*TINY, *drill, f"run_dir={tmp_path}"], timeout=300).value
    report, line = got["report"], got["stopped"]
    assert report["nodes"] == 2 and [r["node"] for r in report["ranks"]] == [0, 0, 1, 1]
    assert report["rounds"] == 3  # the drilled fault is slow in the first round and both re-measured ones
    links = {(d, tuple(v["ranks"])): v["nodes"] for r in report["ranks"] for d, v in r["links"].items()}
    assert {k: v for k, v in links.items() if k[0] != "dp_shard"} == {
        ("intra_node", (0, 1)): [0],
        ("intra_node", (2, 3)): [1],
        ("inter_node", (0, 2)): [0, 1],
        ("inter_node", (1, 3)): [0, 1],
    }
    assert line is not None and "\n" not in line, got
    for needle in named:
        assert needle in line, line
    assert len(report["found"]) == len(named), report["found"]  # nothing else named
