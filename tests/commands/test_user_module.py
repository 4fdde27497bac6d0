"""A ``PretrainModule`` subclass named on the command line (``module._target_``), with its own arguments:
trained and swept through ``main(argv)``, checked by ``plan``, and a wrong one refused in one line (exit code 2)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from helpers import TINY, losses
from lit_titan.train import main

QUICK = [*TINY, "trainer.max_steps=1", "checkpoint.enabled=false", "precision=32-true", "seed=0"]
SCALED = "module._target_=user_modules.ScaledLoss"
# Subclasses whose constructor or step a job cannot use, written to a file the wrong-module cases import.
OWN_MODULES = """
from lit_titan import PretrainModule


class NoKwargs(PretrainModule):
    def __init__(self, alpha=1.0):
        super().__init__()


class NeedsAlpha(PretrainModule):
    def __init__(self, alpha, **kwargs):
        super().__init__(**kwargs)


class OwnStep(PretrainModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)
"""


def test_a_sweep_over_a_subclass_argument_trains_that_class_with_it(tmp_path):
    """Two one-process points, in this process: the same run but for ``+module.scale``, so the first loss
    doubles exactly (the class was built, with the argument the point gave)."""
    sweep = tmp_path / "sweep"
    assert main(["-m", *QUICK, SCALED, "+module.scale=1.0,2.0", f"run_dir={sweep}"]) == {}
    with open(sweep / "summary.csv") as f:
        assert [row["job"] for row in csv.DictReader(f)] == ["0", "1"]
    one, two = losses(sweep / "0"), losses(sweep / "1")
    assert len(one) == len(two) == 1
    assert one[0] > 0.8 * math.log(512)  # the default cross-entropy of an untrained 512-token model
    assert two[0] == pytest.approx(2 * one[0], rel=1e-6)


def test_plan_accepts_a_subclass_and_refuses_a_wrong_one_in_one_line():
    from lit_titan.cli.plan import make_plan
    from lit_titan.config import ConfigError

    assert make_plan([*TINY, SCALED, "+module.scale=2.0"], write=False)["reasons"] == []
    with pytest.raises(ConfigError, match=r"^module._target_=user_modules.IGNORE: not a PretrainModule subclass"):
        make_plan([*TINY, "module._target_=user_modules.IGNORE"], write=False)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["module._target_=no_such_pkg.Module"],
            "module._target_=no_such_pkg.Module: cannot be imported (ModuleNotFoundError: No module named "
            "'no_such_pkg'); give package.module.Class, importable here (on sys.path / PYTHONPATH)",
        ),
        (
            ["module._target_=broken_on_import.Module"],
            "module._target_=broken_on_import.Module: cannot be imported (RuntimeError: broken on purpose); give "
            "package.module.Class, importable here (on sys.path / PYTHONPATH)",
        ),
        (
            ["module._target_=lit_titan.errors.ConfigError"],
            "module._target_=lit_titan.errors.ConfigError: not a PretrainModule subclass (it is the class "
            "lit_titan.errors.ConfigError); subclass lit_titan.PretrainModule (README, Subclassing)",
        ),
        (
            ["module._target_=user_modules.MaskedLabels", "+module.scale=2.0"],
            "module.scale=2.0: user_modules.MaskedLabels takes no argument 'scale'; its own arguments: (none)",
        ),
        (
            [SCALED, "+module.seed=3"],
            "module.seed=3: lit-titan passes seed itself; set seed=... instead",
        ),
        (
            [SCALED, "module.scale=2.0"],
            "module.scale=2.0: not set in conf/train.yaml; add the module's own constructor arguments with a +: "
            "module._target_=package.module.Class +module.<argument>=VALUE",
        ),
        (
            ["module._target_=own_modules.NoKwargs"],
            "module._target_=own_modules.NoKwargs: its constructor takes no 'model', which lit-titan passes (with "
            "model_overrides, optim, seed, init_from_hf, loss_chunk_tokens, step_micro_batch); accept **kwargs and "
            "pass them to PretrainModule.__init__",
        ),
        (
            ["module._target_=own_modules.NeedsAlpha"],
            "module._target_=own_modules.NeedsAlpha: needs its argument 'alpha'; add +module.alpha=VALUE",
        ),
        (
            ["module._target_=own_modules.OwnStep"],
            "module._target_=own_modules.OwnStep: overrides training_step, which TitanStrategy's step runner owns "
            "(one normaliser over every layout); override compute_loss, split_batch, count_targets or "
            "record_train_loss instead",
        ),
    ],
    ids=[
        "not-importable",
        "raises-on-import",
        "not-a-subclass",
        "unknown-argument",
        "built-argument",
        "without-plus",
        "no-kwargs",
        "missing-argument",
        "own-training-step",
    ],
)
def test_a_wrong_module_is_one_line_and_exit_code_2(overrides, line, tmp_path, monkeypatch, capsys):
    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import user_errors

    (tmp_path / "broken_on_import.py").write_text('raise RuntimeError("broken on purpose")\n')
    (tmp_path / "own_modules.py").write_text(OWN_MODULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        run_entry_point(lambda: main([*QUICK, *overrides, f"run_dir={run}"]), user_errors)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lit-titan: error: {line}"]
    assert not Path(run).exists()  # refused before anything was built or written
