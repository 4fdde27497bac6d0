"""Lightning's conventions under TitanStrategy: a Trainer back after fit keeps the trained model (validate and
save_checkpoint on the same Trainer), and ModelCheckpoint's ``save_last`` overwrites ``last.ckpt``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_titan.checkpoint.layout import META_FILE


def _reentry(worlds, out, ranks: int, layout: str | None) -> dict:
    worlds.run(ranks, "scripts.reentry:main", str(out), False, layout)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def one_process(worlds, tmp_path_factory) -> dict:
    return _reentry(worlds, tmp_path_factory.mktemp("reentry") / "one.pt", 1, None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "layout"), [(1, None), (2, None), (2, "tp"), (2, "pp")], ids=["one_process", "dp2", "tp2", "pp2"]
)
def test_validate_test_predict_after_fit_see_the_trained_weights(ranks, layout, one_process, tmp_path, worlds):
    """The validation after fit equals the one at fit's last step (same weights, same batches) and one process's,
    so does the test on the same held-out batches (pp2: through the schedule) and the loss of the predicted logits
    (refused in one line under pp2), and the Trainer saves a checkpoint after fit (its process group still lives)."""
    got = one_process if ranks == 1 else _reentry(worlds, tmp_path / "reentry.pt", ranks, layout)
    assert got["in_fit"] == pytest.approx(one_process["in_fit"], rel=1e-5), (got, one_process)
    assert got["user"] == {"user/batches": 3.0, "user/validations": 1.0}, got  # the subclass's own hooks ran
    assert got["saved"], got
    assert got["after_fit"] == pytest.approx(got["in_fit"], rel=1e-6), got
    assert got["test"] == pytest.approx(got["in_fit"], rel=1e-6), got
    if layout == "pp":
        assert got["predicted"].startswith("trainer.predict under pp=2 cp=1: a rank holds part of the model"), got
    elif ranks == 1 or layout == "tp":  # every rank predicts every row (dp2: rank 0 its own rows only)
        assert got["predicted"] == pytest.approx(got["in_fit"], rel=1e-5), got
    # save_top_k=1 keeps the newest step; last.ckpt was replaced at each step, nothing set aside is left
    assert got["kept"] == ["epoch=0-step=3.ckpt", "last.ckpt"], got
    meta = torch.load(Path(got["ckpt_dir"]) / "last.ckpt" / META_FILE, weights_only=False)
    assert meta["global_step"] == 3, meta.keys()


@pytest.mark.slow
def test_validate_after_fit_mutant_evaluates_fresh_weights(tmp_path, worlds):
    """The check can fail: with the re-entry undone the model is initialised again and the loss moves far."""
    out = tmp_path / "fresh.pt"
    worlds.run(1, "scripts.reentry:main", str(out), True)
    got = torch.load(out, weights_only=True)
    print(f"validation after fit with fresh weights: {got}")
    assert abs(got["after_fit"] - got["in_fit"]) > 1e3 * 1e-6 * got["in_fit"], got


def test_a_single_file_checkpoint_is_refused_in_one_line():
    """Lightning's ``save_distributed_checkpoint=False`` would be ignored (a sharded directory written anyway)."""
    from lit_titan import TitanStrategy

    with pytest.raises(ValueError, match="save_distributed_checkpoint=False.*lit-titan export"):
        TitanStrategy(save_distributed_checkpoint=False)


@pytest.fixture(scope="module")
def single_file(worlds, tmp_path_factory):
    """Two steps under Lightning's default one-device strategy, saved as one file by ``trainer.save_checkpoint``:
    ``single_file(plain)``, the tiny Llama's or the plain LightningModule's (``scripts/plain_module.py``)."""
    made = {}

    def make(plain: bool) -> Path:
        if plain not in made:
            made[plain] = tmp_path_factory.mktemp("single-file") / "source.pt"
            worlds.run(1, "scripts.single_file_resume:save", str(made[plain]), plain)
        return made[plain]

    return make


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "plain"), [(None, False), ("tp", False), ("tp", True)], ids=["dp2", "tp2", "plain_module_tp2"]
)
def test_fit_from_a_single_file_checkpoint_restores_it(layout, plain, single_file, worlds, tmp_path):
    """Every weight and every optimizer state tensor restored exactly (the optimizer state is saved by position:
    a mapping to the wrong parameter would move its moments), and the step; then it trains on."""
    out = tmp_path / "restored.pt"
    source = single_file(plain)
    worlds.run(2, "scripts.single_file_resume:resume", str(out), str(source), layout, plain)
    got, want = torch.load(out, weights_only=True), torch.load(source, weights_only=True)
    assert got["global_step"] == 2
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, t in want["weights"].items():
        assert torch.equal(got["weights"][name], t), name
    assert sorted(got["optimizer"]) == sorted(want["optimizer"])
    for name, state in want["optimizer"].items():
        for key, t in state.items():
            assert torch.equal(torch.as_tensor(got["optimizer"][name][key]), torch.as_tensor(t)), (name, key)


@pytest.mark.slow
def test_a_single_file_checkpoint_under_pipeline_parallelism_is_refused_in_one_line(single_file, worlds, tmp_path):
    """A rank holds only its stages, and the file's optimizer state is keyed by position in the whole model."""
    from world import CaseFailed

    with pytest.raises(CaseFailed) as info:
        worlds.run(2, "scripts.single_file_resume:resume", str(tmp_path / "x.pt"), str(single_file(False)), "pp")
    assert "resume it under the layout it was saved with, or under one without pipeline parallelism" in str(info.value)
