"""The step runner's pieces: the loss contract, the refusals, and the labels the data marks unpredictable.

Fast (no process group); the runner itself is proven by the parity cases (tests/parity/test_user_loss.py,
tests/parity/test_validation.py) and its ownership of the step by tests/unit/test_house_rules.py.
"""

from __future__ import annotations

import pytest
import torch

from lit_titan import PretrainModule
from lit_titan.data.documents import crossing_labels
from lit_titan.strategies.step import IGNORE_INDEX, count_valid, micro_parts, weigh
from lit_titan.strategies.strategy import _own_loss, _refuse_own_step

EOS = 0


def test_a_mean_and_per_target_losses_weigh_to_the_same_sum():
    labels = torch.tensor([[3, 4, IGNORE_INDEX], [5, IGNORE_INDEX, IGNORE_INDEX]])
    per_target = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    count, factor = count_valid(labels), torch.tensor(0.5, dtype=torch.float64)
    assert int(count) == 3
    mean = per_target.sum() / count
    assert torch.allclose(weigh(mean, labels, count, factor), weigh(per_target, labels, count, factor))
    assert float(weigh(per_target.flatten(), labels, count, factor)) == pytest.approx(3.5)


def test_a_loss_of_another_shape_is_one_line():
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"shape \(2,\) for labels of shape \(2, 3\): return the mean") as err:
        weigh(torch.ones(2), labels, count_valid(labels), torch.tensor(1.0))
    assert "\n" not in str(err.value)


def test_micro_parts_slice_per_token_inputs_alike():
    inputs, labels = torch.arange(12).view(4, 3), torch.arange(12).view(4, 3) + 1
    parts = micro_parts(inputs, labels, {"documents": torch.zeros(4, 3)}, 2)
    assert [p[0].shape[0] for p in parts] == [2, 2] and torch.equal(parts[1][1], labels[2:])
    assert parts[1][2]["documents"].shape == (2, 3)


class _OwnStep(PretrainModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)


class _OwnLoss(PretrainModule):
    def compute_loss(self, logits, labels):
        return super().compute_loss(logits, labels)


def test_an_own_training_step_is_refused_in_one_line_naming_the_override_points():
    with pytest.raises(TypeError, match="override compute_loss, split_batch, count_targets or record_train_loss"):
        _refuse_own_step(_OwnStep(), "training_step")
    _refuse_own_step(PretrainModule(), "training_step")
    _refuse_own_step(_OwnLoss(), "validation_step")


def test_an_own_compute_loss_gets_whole_logits_under_tensor_parallel():
    assert _own_loss(_OwnLoss()) and not _own_loss(PretrainModule()) and not _own_loss(_OwnStep())


def test_document_masking_ignores_each_eos_label():
    rows = torch.tensor([[5, 6, EOS, 7, 8, EOS, 9, 10, 11], [12, 13, 14, EOS, 15, 16, 17, 18, 19]])
    ignore = torch.from_numpy(crossing_labels(rows.numpy(), EOS))
    assert torch.equal(ignore, rows[:, :-1] == EOS)
    inputs, labels, extra = PretrainModule().inputs_and_labels({"tokens": rows, "documents": rows, "ignore": ignore})
    assert sorted(extra) == ["documents"] and int((labels == IGNORE_INDEX).sum()) == 3
    assert torch.equal(labels[ignore], torch.full((3,), IGNORE_INDEX)) and torch.equal(
        labels[~ignore], rows[:, 1:][~ignore]
    )


@pytest.mark.slow
def test_lightnings_accumulate_grad_batches_trains_as_data_micro_batches(tmp_path, worlds):
    """``Trainer(accumulate_grad_batches=2)`` under TitanStrategy: the step runner takes it over (two micro-batches
    of the rank's whole step), the same gradients as ``data.micro_batch_size=4``, and two steps, not four."""
    runs = {}
    for name, accumulate, micro in (("lightning", 2, None), ("data", 1, 4)):
        out = tmp_path / f"{name}.pt"
        worlds.run(1, "scripts.lightning_accumulation:main", str(out), accumulate, micro)
        runs[name] = torch.load(out, weights_only=True)
    assert runs["lightning"]["steps"] == runs["data"]["steps"] == 2
    assert runs["lightning"]["micro_batches"] == runs["data"]["micro_batches"] == 2
    for name, grad in runs["data"]["grads"].items():
        assert torch.allclose(runs["lightning"]["grads"][name], grad, rtol=0, atol=1e-7 * grad.abs().max()), name
