"""``python -m lit_titan.train`` as a Hydra app: sweeps, user config dirs, display flags, submitit, bad input."""

from __future__ import annotations

import csv
import stat
import sys
from pathlib import Path

import pytest
import yaml

from helpers import TINY, assert_losses_match, losses, run_job
from lit_titan.config import ConfigError
from lit_titan.train import main

QUICK = [*TINY, "trainer.max_steps=2", "checkpoint.enabled=false"]


def _summary(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def test_multirun_runs_each_point_in_its_own_run_dir_and_writes_a_summary(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    secret = "ltsecret-sweep-9f3c1e7a"  # held, never read (data=stdlib): no record or printed line may show it
    assert (
        main(
            ["-m", *QUICK, "seed=0,1", f"data.storage_options={{aws_secret_access_key: {secret}}}", f"run_dir={sweep}"]
        )
        == {}
    )
    printed = capsys.readouterr()
    assert secret not in printed.out + printed.err
    assert [p for p in sweep.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []
    assert (sweep / "multirun.yaml").is_file() and stat.S_IMODE((sweep / "multirun.yaml").stat().st_mode) == 0o600
    rows = _summary(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    for n, row in enumerate(rows):
        point = sweep / str(n)
        assert row["run_dir"] == str(point)
        # Hydra's record of the point, and our resolved config naming the point as run_dir
        assert f"seed={n}" in yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text())
        assert (point / ".hydra" / "config.yaml").is_file()
        assert yaml.safe_load((point / "config.yaml").read_text())["run_dir"] == str(point)
        assert float(row["final_loss"]) == losses(point)[-1] and row["steps"] == "2"
    assert losses(sweep / "0") != losses(sweep / "1")  # two seeds, two different runs


def _user_config_dir(root: Path) -> Path:
    """A team's own files kept outside the package, composing with ours (defaults lists name our files)."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "my_llama.yaml").write_text(
        "defaults:\n  - llama3_debug\n  - _self_\ndim: 64\nn_layers: 2\nn_heads: 4\nn_kv_heads: 2\nvocab_size: 512\n"
    )
    (root / "cluster").mkdir()
    (root / "cluster" / "my_fleet.yaml").write_text("defaults:\n  - cpu\n  - _self_\npartition: my_fleet\n")
    (root / "logger").mkdir()  # any Lightning logger class by _target_
    (root / "logger" / "mine.yaml").write_text(
        "mine:\n  _target_: lightning.pytorch.loggers.CSVLogger\n  save_dir: ${run_dir}\n  name: mine\n  version: ''\n"
    )
    return root


def test_user_config_dir_loggers_and_profiler_by_target(tmp_path):
    conf = _user_config_dir(tmp_path / "team_conf")
    run = tmp_path / "run"
    summary = main(
        [
            "--config-dir",
            str(conf),
            *QUICK,
            "model=my_llama",
            "cluster=my_fleet",
            "logger=[csv,tensorboard,mine]",
            "profiler=simple",
            f"run_dir={run}",
        ]
    )
    assert summary["steps"] == 2 and summary["run_dir"] == str(run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["model"]["dim"], cfg["model"]["name"], cfg["cluster"]["partition"]) == (64, "llama3_debug", "my_fleet")
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    assert "model=my_llama" in overrides and f"run_dir={run}" in overrides
    assert len(losses(run)) == 2  # metrics.csv, as always
    assert len(losses(run / "mine")) == 2  # the user's logger, instantiated from its _target_
    assert any((run / "tensorboard").rglob("events.out.tfevents*"))
    assert list(run.glob("*profile*.txt")), sorted(p.name for p in run.iterdir())  # SimpleProfiler's report


def test_searchpath_and_cfg_display(tmp_path, capsys):
    conf = _user_config_dir(tmp_path / "team_conf")
    main(["--cfg", "job", f"hydra.searchpath=[file://{conf}]", "model=my_llama", "seed=3"])
    job = yaml.safe_load(capsys.readouterr().out)
    assert (job["model"]["dim"], job["seed"]) == (64, 3)
    main(["--cfg", "trainer.max_steps=7"])  # lit-titan's earlier form: the resolved job config
    assert yaml.safe_load(capsys.readouterr().out)["optim"]["total_steps"] == 7
    main(["--cfg", "hydra", "run_dir=/somewhere"])
    hydra_cfg = yaml.safe_load(capsys.readouterr().out)["hydra"]
    assert hydra_cfg["run"]["dir"].startswith("${lit_titan.run_dir:")  # Hydra's run dir is run_dir
    main(["--help"])
    out = capsys.readouterr().out
    for line in ("logger: csv, tensorboard, wandb", "profiler: advanced, pytorch, simple", "model: "):
        assert line in out, out
    assert "llama3_405b" in next(line for line in out.splitlines() if line.startswith("model: ")), out


def test_info_and_help_from_the_command_line(tmp_path):
    conf = _user_config_dir(tmp_path / "team_conf")
    proc = run_job(
        [sys.executable, "-m", "lit_titan.train", "--config-dir", str(conf), "--info", "searchpath"], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"file://{conf}" in proc.stdout and "conf" in proc.stdout


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["-m", "hydra/launcher=slurmish"],
            "hydra/launcher=slurmish: not a launcher; choose one of basic, submitit_local",
        ),
        (["-m", "optim.lrr=1e-3,3e-4"], "optim.lrr is not a config key"),
        (["--config-dir", "/nonexistent/team_conf"], "--config-dir /nonexistent/team_conf: no such directory"),
        (["seed=0,1"], "add -m (--multirun)"),
        (["logger=[csv,mlflow]"], "logger=mlflow: no such option; choose one of csv, tensorboard, wandb"),
        (
            ["hydra/launcher=submitit_local", "cluster.devices=2", "hydra.launcher.tasks_per_node=1"],
            "= 1 ranks but the layout needs cluster.num_nodes x cluster.devices = 2",
        ),
        (["hydra/launcher=submitit_slurm", "cluster=h100_8", "cluster.devices=16"], "cluster.gpus_per_node=8"),
        (["hydra/launcher=submitit_local", "cluster.num_nodes=2"], "submitit_local runs one node"),
        (
            ["-m", "cluster.devices=2,3", "parallel.tp=2"],
            "cluster.devices",
        ),  # every point is checked, not only the first
    ],
)
def test_bad_launch_input_is_one_line_naming_the_setting(argv, needle, tmp_path):
    with pytest.raises((ConfigError, ValueError)) as err:
        main([*argv, f"run_dir={tmp_path / 'run'}"])
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_bad_sweep_from_the_command_line_is_one_line(tmp_path):
    proc = run_job(
        [sys.executable, "-m", "lit_titan.train", "-m", "seed=0,1", "optim.lrr=1e-3", f"run_dir={tmp_path / 'sweep'}"],
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "lit-titan: error: optim.lrr=1e-3: optim.lrr is not a config key; check its spelling (python -m "
        "lit_titan.train --cfg job lists every key); a new key needs a yaml line and one line in lit_titan/optim/settings.py "
        "(docs/configuration.md)"
    ]
    assert not (tmp_path / "sweep").exists()


PARITY = [*TINY, "trainer.max_steps=4", "precision=32-true", "checkpoint.enabled=false", "seed=0"]


@pytest.mark.slow
def test_sweep_point_with_two_processes_runs_in_a_fresh_process_and_matches_one(tmp_path):
    """Lightning issue 11300: the devices=2 point re-runs its own command line, not the sweep."""
    sweep = tmp_path / "sweep"
    proc = run_job(
        [sys.executable, "-m", "lit_titan.train", "-m", *PARITY, "cluster.devices=1,2", f"run_dir={sweep}"], timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert [r["job"] for r in _summary(sweep)] == ["0", "1"]  # two points, not a sweep re-entered by a child
    assert not (sweep / "1" / "0").exists()
    assert_losses_match(losses(sweep / "1"), losses(sweep / "0"), rtol=1e-6)


@pytest.mark.slow
def test_submitit_local_two_tasks_match_one_process_and_devices_2(tmp_path, worlds):
    """hydra/launcher=submitit_local: two submitit tasks, one rank each, under Lightning's SLURMEnvironment."""
    job = tmp_path / "submitit"
    proc = run_job(
        [
            sys.executable,
            "-m",
            "lit_titan.train",
            "hydra/launcher=submitit_local",
            "cluster.devices=2",
            *PARITY,
            f"run_dir={job}",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    logs = "".join(p.read_text(errors="replace") for p in (job / ".submitit").rglob("*_log.out"))
    assert "task 0 of 2 trained under SLURMEnvironment" in logs and "task 1 of 2 trained under SLURMEnvironment" in logs
    main([*PARITY, f"run_dir={tmp_path / 'one'}"])
    worlds.train([*PARITY, "cluster.devices=2"], tmp_path / "devices2")
    got = losses(job / "0")
    assert_losses_match(got, losses(tmp_path / "one"), rtol=1e-6)
    assert_losses_match(got, losses(tmp_path / "devices2"), rtol=1e-6)
    assert _summary(job)[0]["final_loss"] == str(got[-1])


def test_a_display_command_then_an_in_process_run_prints_no_stale_continue_command(tmp_path, capsys):
    """A notebook's ``main(["--cfg", "job"])`` leaves Hydra's record of that command (its output_dir is
    never set). A later ``train(cfg)`` in the same process once failed on it (MissingMandatoryValue)."""
    from lit_titan.config import compose
    from lit_titan.job.resume import continue_command

    main(["--cfg", "job", "seed=3"])
    capsys.readouterr()
    assert continue_command(compose([*TINY, f"run_dir={tmp_path}"]), tmp_path) is None
