"""A new user's first hour: a quiet default run, a bar in optimizer steps, end lines that say what next.

Through the real command line (a subprocess, stdout a pipe: the progress bar's plain-line mode, as in
CI logs and Slurm output files).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import warnings
from pathlib import Path

import pytest

from helpers import README_VERIFY, TINY, noise, read_metrics, run_cli, run_job
from paths import ROOT


def test_noise_finds_warnings_in_python_and_lightning_formats():
    lightning = "/x/lightning/fabric/loggers/csv_logs.py:268: Experiment logs directory /r/ exists and is not empty."
    python = "/x/datamodule.py:322: UserWarning: The validation split yields 13 sequences"
    assert noise("\n".join(["step 1/2 | loss 8.1 | 5 tokens/s", lightning, python, "lit-titan: 2 steps"])) == [
        lightning,
        python,
    ]
    named = ["lit-titan: outputs in /tmp/test_warn_names_0", "python -m lit_titan.train preflight.action=warn"]
    said = ["WARNING: rank 2 is slow", "lit-titan: warning: x", "a DeprecationWarning here", "FutureWarning: y"]
    assert noise("\n".join(named + said)) == said


@pytest.mark.slow
def test_every_world_case_is_read_by_the_same_matcher(worlds):
    """A case whose ranks print a warning (or traceback) line fails, naming the rank's log; a case that
    asks for that line passes (tests/support/world.py). The 2-process world is the one the slow suite keeps up."""
    from world import CaseFailed

    line = "/x/mine.py:1: UserWarning: deliberate"
    worlds.run(2, "builtins:print", line, allow_noise=("deliberate",))
    with pytest.raises(CaseFailed, match=r"(?s)printed 2 unexpected .*rank0\.log: /x/mine\.py:1: UserWarning"):
        worlds.run(2, "builtins:print", line)
    worlds.run(2, "builtins:print", "step 1/2 | loss 8.1")  # the world is still up and clean


def test_every_command_line_is_read_by_the_same_matcher():
    """A command line that exits 0 and prints a warning line fails (helpers.Job.wait); one that asks for
    that line, or exits non-zero (the test judges its error), passes. A bare interpreter: no import cost."""
    warn = [sys.executable, "-c", "import warnings; warnings.warn('deliberate')"]
    with pytest.raises(AssertionError, match=r"(?s)succeeded but printed 1 unexpected .*UserWarning: deliberate"):
        run_job(warn, timeout=60)
    run_job(warn, timeout=60, allow_noise=("deliberate",))
    assert run_job([*warn[:-1], warn[-1] + "; raise SystemExit(3)"], timeout=60).returncode == 3


def step_lines(output: str) -> list[tuple[int, int]]:
    return [
        (int(m.group(1)), int(m.group(2)))
        for m in re.finditer(r"^step (\d+)/(\d+) \| loss [\d.]+ \| ", output, re.MULTILINE)
    ]


def continue_command(output: str) -> str:
    found = re.findall(r"^lit-titan: train \d+ more steps? from the last checkpoint: (.+)$", output, re.MULTILINE)
    assert len(found) == 1, output[-3000:]
    return found[0]


@pytest.mark.slow
def test_default_run_is_quiet_and_its_printed_continue_command_continues_it(tmp_path):
    """README's first command (short max_steps), then the command its last lines print, run as printed."""
    run = tmp_path / "run"
    first = run_cli(["trainer.max_steps=2"], run)
    out = first.stdout + first.stderr
    assert noise(out) == [], out[-4000:]
    assert step_lines(first.stdout) == [(1, 2), (2, 2)], first.stdout[-2000:]
    assert re.search(r"^lit-titan: 2 steps, [\d,]+ tokens, final train/loss [\d.]+, [\d,.]+ tokens/s", out, re.M), out
    assert f"lit-titan: see the metrics: lit-titan report {run}" in out

    command = continue_command(out)
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "lit_titan.train"], command
    second = run_job([sys.executable, *argv[1:]], timeout=600)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-6000:]
    assert "resume=auto: resuming from" in out2 and "step-000002" in out2, out2[-3000:]
    assert noise(out2) == [], out2[-4000:]
    assert step_lines(second.stdout) == [(3, 4), (4, 4)], second.stdout[-2000:]  # continues, from step 2 on
    steps = [int(r["step"]) for r in read_metrics(run) if r.get("train/loss")]
    assert steps == [2, 3], steps  # this attempt's rows; the first attempt's are in metrics.attempt-0.csv

    from lit_titan.cli.report import main as report  # the other printed command (in-process: no imports)

    report([str(run)])
    assert (run / "report.html").stat().st_size > 0


def _own_text(directory: Path) -> Path:
    """A directory of .txt files, as a user's own text (the interpreter's library source as prose)."""
    directory.mkdir()
    sources = sorted(Path(os.__file__).parent.glob("*.py"))[:40]
    for i in range(4):
        (directory / f"part{i}.txt").write_text("\n".join(p.read_text(errors="ignore") for p in sources[i::4]))
    return directory


@pytest.mark.slow
def test_two_process_run_on_own_text_with_accumulation_is_quiet_and_counts_optimizer_steps(tmp_path):
    """README's own-text command on 2 ranks x 2 micro-batches per step: one progress line per optimizer step."""
    texts = _own_text(tmp_path / "my_texts")
    proc = run_cli(
        [
            *TINY,
            "data=text",
            f"data.path={texts}",
            "cluster=cpu",
            "cluster.devices=2",
            "data.micro_batch_size=2",
            "trainer.max_steps=3",
            "trainer.enable_progress_bar=true",
            "checkpoint.enabled=false",
        ],
        tmp_path / "run",
    )
    out = proc.stdout + proc.stderr
    assert noise(out) == [], out[-4000:]
    assert step_lines(proc.stdout) == [(1, 3), (2, 3), (3, 3)], proc.stdout[-2000:]
    assert "more steps from the last checkpoint" not in out  # no checkpoint, no continue command


def test_plain_progress_line_names_step_loss_throughput_and_times():
    from lit_titan.callbacks import StepProgressBar

    line = StepProgressBar.plain_line(37, 100, 5.12345, 3110.4, 12.2, 37)
    assert line == "step 37/100 | loss 5.1235 | 3,110 tokens/s | elapsed 0:00:12 | remaining 0:00:21"


def test_known_warnings_hide_exactly_the_listed_messages():
    import lit_titan  # noqa: F401 - installs the filters
    from lit_titan.known_warnings import KNOWN_WARNINGS

    leaf = next(k for k in KNOWN_WARNINGS if "LeafSpec" in k.message)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # what a user's -W default would do, before ours
        from lit_titan import known_warnings

        known_warnings._installed = False
        known_warnings.install()
        text = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
        warnings.warn_explicit(text, FutureWarning, "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit(text, FutureWarning, "mine.py", 1, module="my_project.models")  # other module
        warnings.warn_explicit(
            "something new", FutureWarning, "_pytree.py", 22, module="lightning.pytorch.utilities._pytree"
        )
    assert re.match(leaf.module, "lightning.pytorch.utilities._pytree")
    assert [(str(w.message)[:20], w.filename) for w in seen] == [
        (text[:20], "mine.py"),
        ("something new", "_pytree.py"),
    ]


def test_known_log_lines_of_torch_are_dropped_and_others_kept(caplog):
    """torchao's enum registration (every plan with Float8), DTensor's per-rank note on the grad norm and
    inductor's on-disk cache miss."""
    import logging

    import lit_titan  # noqa: F401 - installs the filters

    pytree, redistribute = (
        logging.getLogger("torch.utils._pytree"),
        logging.getLogger("torch.distributed.tensor._redistribute"),
    )
    codecache = logging.getLogger("torch._inductor.codecache")
    with caplog.at_level(logging.WARNING):
        pytree.warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.",
            "<enum 'KernelPreference'>",
        )
        redistribute.warning(
            "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), "
            "Replicate()), 2 sequential all_reduce operations will be performed."
        )
        redistribute.warning("While redistributing from (Shard(0),) to (Replicate(),), something new")
        try:  # as inductor logs it: the message with the pickling error's traceback
            raise TypeError("cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")
        except TypeError:
            codecache.warning("fx graph cache unable to serialize compiled graph", exc_info=True)
    assert [r.getMessage()[-13:] for r in caplog.records] == ["something new"]


def _conf_groups_on_disk() -> dict[str, list[str]]:
    """Every directory of conf/ holding yaml files, and its files: read here independently of lit_titan.cli.usage."""
    from lit_titan.config import conf_dir

    root = conf_dir()
    out: dict[str, list[str]] = {}
    for path in root.rglob("*.yaml"):
        if path.parent != root:
            out.setdefault(path.parent.relative_to(root).as_posix(), []).append(path.stem)
    return out


@pytest.mark.parametrize("command", ["train", "plan", "prepare", "launch"])
def test_help_of_every_entry_point_lists_every_group_and_option(command, capsys):
    import importlib

    importlib.import_module(f"lit_titan.cli.{command}").main(["--help"])
    out = capsys.readouterr().out
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1].split(", ") for line in out.splitlines() if ": " in line}
    on_disk = _conf_groups_on_disk()
    assert {"model", "data", "cluster", "logger", "callbacks", "recipe", "hydra/launcher"} <= set(on_disk)
    for group, options in on_disk.items():
        assert group in lines, f"{group} missing from {command} --help:\n{out}"
        assert set(options) <= set(lines[group]), (group, options, lines[group])
    from lit_titan.cli.usage import KEYS

    for key, _ in KEYS:
        assert re.search(rf"^{re.escape(key)} +\S", out, re.MULTILINE), f"{key} missing from {command} --help"
    if command in ("train", "launch"):
        assert len(re.findall(r"^(python -m lit_titan\.\w+|lit-titan \w+) ", out.split("== Examples ==")[1], re.M)) == 3


def test_most_used_keys_in_help_exist_in_the_config():
    from omegaconf import OmegaConf

    from lit_titan.cli.usage import KEYS
    from lit_titan.config import compose

    cfg = compose(["data=text", "data.path=/nowhere"])  # data.path belongs to data=text|tokens
    missing = [key for key, _ in KEYS if OmegaConf.select(cfg, key, default="<missing>") == "<missing>"]
    assert missing == []


def test_lit_titan_help_lists_every_subcommand(capsys):
    from lit_titan.cli import commands as cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert re.search(rf"^  {name} +\S", out, re.MULTILINE), out
    with pytest.raises(SystemExit):
        import lit_titan.cli.export as export

        export.main(["--help"])
    assert "llama3_405b" in capsys.readouterr().out  # export's --model lists the flavors of conf/model/


def test_help_imports_neither_torch_nor_lightning():
    """`python -m lit_titan.train --help` and `lit-titan --help` answer without the training stack.

    What is asserted is the cause of a slow answer (torch and Lightning take seconds to import), not
    a wall-clock bound, which a loaded machine would break: one fresh interpreter runs both help paths
    as the command line does, then lists what they imported.
    """
    code = (
        "import contextlib, io, runpy, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    sys.argv = ['lit_titan.train', '--help']\n"
        "    runpy.run_module('lit_titan.train', run_name='__main__')\n"
        "    try:\n"
        "        runpy.run_module('lit_titan.cli', run_name='__main__')\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, done.code\n"
        "assert '== Config groups' in out.getvalue() and 'commands:' in out.getvalue(), out.getvalue()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'numpy', 'litdata'}))\n"
    )
    proc = run_job([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


# Each command of README's "First hour" section -> where the tests run it.
README_COMMANDS = {
    "python -m lit_titan.train data=text data.path=my_texts/ trainer.max_steps=200": "test_two_process_run_on_own_text_with_accumulation_is_quiet_and_counts_optimizer_steps",
    "python -m lit_titan.train <notebook 04's SETTINGS + LAYOUT> run_dir=runs/to_parallel/dp2_tp2": "tests/docs/test_notebooks.py::test_notebook_runs[04_notebook_to_parallel]",
    README_VERIFY: "tests/commands/test_verify_command.py::test_readme_verify_command",
}


def _first_hour_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## First hour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return [" ".join(block.replace("\\\n", " ").split()) for block in blocks]


def test_readme_first_hour_commands_are_exercised():
    """Every command in README's "First hour" is one the tests run (the printed next-step lines are run by
    test_default_run_is_quiet_and_its_printed_continue_command_continues_it)."""
    nb = json.loads((ROOT / "notebooks" / "04_notebook_to_parallel.ipynb").read_text())
    setup = next("".join(c["source"]) for c in nb["cells"] if "SETTINGS = [" in "".join(c["source"]))
    scope: dict = {}
    exec(setup, scope)  # the notebook's own definitions of the job it launches
    notebook_job = " ".join(
        ["python -m lit_titan.train", *scope["SETTINGS"], *scope["LAYOUT"], "run_dir=runs/to_parallel/dp2_tp2"]
    )
    commands = _first_hour_commands()
    assert notebook_job in commands, (notebook_job, commands)
    named = {
        c
        if c != notebook_job
        else "python -m lit_titan.train <notebook 04's SETTINGS + LAYOUT> run_dir=runs/to_parallel/dp2_tp2"
        for c in commands
    }
    assert named == set(README_COMMANDS), named
    for where in README_COMMANDS.values():
        path, _, test = where.rpartition("::")
        source = (ROOT / path).read_text() if path else ""
        assert test.split("[")[0] in globals() or f"def {test.split('[')[0]}(" in source, where


def test_csv_logger_warns_only_when_it_would_replace_metrics(tmp_path):
    """A run directory holding Hydra's record is normal (no warning); an earlier metrics.csv is not (warning)."""
    from lit_titan.observe.csv_logger import RunDirCSVLogger

    (tmp_path / ".hydra").mkdir()
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        RunDirCSVLogger(save_dir=str(tmp_path), name="", version="").experiment  # noqa: B018 - creates the file
    assert [str(w.message) for w in seen] == []
    (tmp_path / "metrics.csv").write_text("step,train/loss\n0,9.0\n")
    with pytest.warns(UserWarning, match="metrics.csv exists from an earlier run"):
        RunDirCSVLogger(save_dir=str(tmp_path), name="", version="").experiment  # noqa: B018 - creates the file
    assert not (tmp_path / "metrics.csv").exists()


def test_end_lines_name_tensorboard_and_mfu_when_known_and_only_outputs_that_exist(tmp_path):
    from lit_titan.callbacks import RunSummary
    from lit_titan.config import compose
    from lit_titan.job.build import tensorboard_dir

    run = tmp_path / "a"
    tensorboard = tensorboard_dir(compose(["logger=[csv,tensorboard]", f"run_dir={run}"]))
    assert tensorboard == f"{run}/tensorboard" and tensorboard_dir(compose([f"run_dir={run}"])) is None
    figures = {
        "steps": 3,
        "tokens": 12288,
        "final_loss": 8.7,
        "tokens_per_second": 192.5,
        "train_seconds": 63.8,
        "mfu": 0.412,
    }
    # No checkpoints (checkpoint.enabled=false) and a TensorBoard logger that has not written: neither is named.
    summary = RunSummary(str(run), continue_command=None, tensorboard_dir=tensorboard)
    summary.summary = figures
    lines = summary.lines()
    assert (
        lines[0] == "lit-titan: 3 steps, 12,288 tokens, final train/loss 8.7000, 192.5 tokens/s over 63.8 s, MFU 41.2%"
    )
    assert lines[1] == f"lit-titan: outputs in {run} (metrics.csv)"
    assert not any("tensorboard" in line.lower() for line in lines)
    assert not any("more step" in line for line in lines)  # no checkpoint to continue from: no command
    (run / "tensorboard").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    summary = RunSummary(
        str(run),
        continue_command="python -m lit_titan.train resume=auto",
        tensorboard_dir=tensorboard,
        checkpoint_dir=str(run / "checkpoints"),
    )
    summary.summary = figures
    lines = summary.lines()
    assert lines[1] == f"lit-titan: outputs in {run} (metrics.csv, config.yaml, checkpoints/, tensorboard/)"
    assert f"lit-titan: TensorBoard: tensorboard --logdir {run}/tensorboard" in lines
