"""``lit-titan verify`` as a user runs it: on this machine (both sides in processes it starts), under torchrun
(the layout on the job's ranks, the reference on rank 0), with a module given by ``module._target_``; bad input is
one line before anything runs. Layouts and mutants: tests/parity/test_verify_layouts.py."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import README_VERIFY, TINY, run_job
from paths import SUPPORT

pytestmark = pytest.mark.slow

JOB = [*TINY, "seed=0", "optim.lr=1e-2", "trainer.gradient_clip_val=0.3"]


def _env() -> dict[str, str]:
    """The user's module importable by every process the command starts."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}


def test_verify_passes_a_subclass_from_the_command_line(tmp_path):
    argv = [*JOB, "cluster.devices=2", "module._target_=user_modules.ScaledLoss", "+module.scale=2.0"]
    proc = run_job([sys.executable, "-m", "lit_titan.cli.verify", *argv, f"run_dir={tmp_path}"], env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "dp_shard 2 (2 ranks) against one process, precision 64-true" in out
    assert "verdict: PASS" in out and "known norm: every gradient 1" in out
    assert "grad ratio 1.000000000" in out and "reduce-scatter mean in float64" in out
    rows = (tmp_path / "verify.csv").read_text().splitlines()
    assert len(rows) == 1 + 21  # every parameter of the 2-layer model


def test_readme_verify_command(tmp_path):
    """As README prints it, from a fresh directory: the report on screen, its files under runs/."""
    proc = run_job([sys.executable, "-m", "lit_titan.cli", *README_VERIFY.split()[1:]], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lit-titan verify: dp_shard 2 x tp 2 (4 ranks) against one process" in proc.stdout
    assert "verdict: PASS" in proc.stdout
    (report,) = (tmp_path / "runs").glob("llama3_debug-verify-*/verify.txt")
    assert "verdict: PASS" in report.read_text()


def test_verify_under_torchrun(tmp_path):
    from world import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}"]
    argv = [*JOB, "cluster.devices=2", "parallel.tp=2", f"run_dir={tmp_path}"]
    proc = run_job([*cmd, "-m", "lit_titan.cli.verify", *argv], env=_env(), allow_noise=("torch.distributed.run",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("verdict: PASS") == 1  # rank 0 judges
    assert "replicas: 60 replicated tensors compared after every step: all bitwise equal" in proc.stdout
    assert (tmp_path / "layout" / "dump" / "step-000002.pt").exists()


def test_a_wrong_module_is_one_line_and_exit_code_2(tmp_path):
    proc = run_job(
        [sys.executable, "-m", "lit_titan.cli.verify", *JOB, "module._target_=no_such.Module", f"run_dir={tmp_path}"]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "module._target_=no_such.Module" in proc.stderr
    assert not (tmp_path / "layout.log").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["model=llama3_8b", "cluster.devices=2"], "GiB in one process in 64-true"),
        ([*JOB, "verify.step=3"], "verify.step=3: verify takes verify.steps="),
        ([*JOB, "verify.precision=bf16-true"], "verify.precision=bf16-true: 64-true (default) or 32-true"),
        ([*JOB, "-m", "seed=0,1"], "verify checks one job: drop -m"),
        ([*JOB, "cluster.devices=3", "parallel.tp=2"], "parallel.dp_shard=-1"),
        (["cluster=h100_64"], "verify runs both sides on this machine; run it on the job's nodes under torchrun"),
        ([*JOB, "run_dir=EARLIER"], "holds an earlier check"),
    ],
)
def test_bad_input_is_refused_before_any_run(argv, line, tmp_path):
    from lit_titan.config import ConfigError
    from lit_titan.verify.check import run_verify

    def never(*args):
        raise AssertionError("a side ran")

    (tmp_path / "earlier" / "layout").mkdir(parents=True)
    argv = [a.replace("EARLIER", str(tmp_path / "earlier")) for a in argv]
    with pytest.raises(ValueError) as err:
        run_verify([*argv, f"run_dir={tmp_path}"] if not any("run_dir=" in a for a in argv) else argv, never)
    assert line in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, ConfigError) or type(err.value).__name__ == "LayoutError"


def test_shrink_keeps_what_shapes_the_plan():
    """Fewer layers (an MoE layer kept), the shortest sequence the layout divides, the batch split kept."""
    from lit_titan.config import compose
    from lit_titan.verify.shrink import shrink

    argv = [
        "model=qwen3_moe_debug",
        "model.moe.aux_loss=sequence",
        "cluster.devices=4",
        "parallel.pp=2",
        "parallel.cp=2",
        "data.micro_batch_size=4",
    ]
    shrunk = shrink(compose(argv), argv, steps=3, precision="64-true", world_on_one_host=True)
    spec = shrunk.spec
    assert (spec.dims.pp, spec.dims.cp, spec.dims.dp) == (2, 2, 1)
    assert spec.model.n_layers < 4 and any(spec.model.is_moe(k) for k in range(spec.model.n_layers))
    assert spec.seq_len < 256 and spec.seq_len % 4 == 0
    assert spec.batch.accumulation == 2 and spec.precision == "64-true"
    assert "parallel.cp=1" in shrunk.reference and "cluster.devices=1" in shrunk.reference
    # two CPU "nodes" of 2 processes: the same 4 ranks on this machine
    two_nodes = ["cluster.num_nodes=2", "cluster.devices=2", "parallel.tp=2"]
    shrunk = shrink(compose(two_nodes), two_nodes, steps=3, precision="64-true", world_on_one_host=True)
    assert (shrunk.spec.dims.world_size, shrunk.spec.dims.tp) == (4, 2)
    assert {"cluster.devices=4", "cluster.num_nodes=1"} <= set(shrunk.layout)


def test_fp32_round_off_in_a_float64_check_gets_a_hint_and_a_real_bug_none():
    from lit_titan.verify.compare import ParameterRow, Report
    from lit_titan.verify.report import TOLERANCES, Verdict

    def verdict(error: float, ratio: float) -> Verdict:
        report = Report()
        report.add("grads", error, "step 1 layers.0.attention.wq.weight")
        row = ParameterRow("layers.0.attention.wq.weight", ratio, error, error, 1)
        return Verdict(
            "tp 2 (2 ranks)",
            "64-true",
            TOLERANCES["64-true"][0],
            report,
            [row],
            [(6.7, 6.7)],
            [(1.0, 1.0)],
            0.3,
            (2.0, 2.0),
            1e-10,
            {"divergent": [], "checked": 4},
            {},
        )

    assert "hint: errors this small" in verdict(3e-7, 1.0 + 1e-9).render()
    assert "hint:" not in verdict(0.5, 2.0).render() and "verdict: FAIL" in verdict(0.5, 2.0).render()


def test_the_per_layout_benchmark_shrinks_every_layout_it_names():
    """benchmarks/verify_layouts.py (docs/benchmarks.md's table): every layout composes, validates and shrinks."""
    import importlib.util

    from paths import ROOT

    spec = importlib.util.spec_from_file_location("verify_layouts", ROOT / "benchmarks" / "verify_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.dry_run(list(module.LAYOUTS))
    assert len(rows) == len(module.LAYOUTS) == 25 and all("ranks)" in r for r in rows)
