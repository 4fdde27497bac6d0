"""The Timeline's memory and file handles stay bounded however long the run."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import torch

from lit_titan.callbacks import timeline as timeline_module
from lit_titan.callbacks.timeline import RECENT_ROWS, TIMELINE_COLUMNS, Timeline
from lit_titan.observe.phases import PhaseClock


def _steps(cb: Timeline, trainer: SimpleNamespace, n: int) -> None:
    for _ in range(n):
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, None, None, 0)


def test_rows_are_written_on_logging_steps_and_only_the_latest_kept(tmp_path, monkeypatch):
    opens = []
    real_open = open
    monkeypatch.setattr(
        timeline_module, "open", lambda *a, **k: opens.append(a[0]) or real_open(*a, **k), raising=False
    )
    cb = Timeline()
    cb.path = tmp_path / "rank-0.csv"
    cb.path.write_text(",".join(TIMELINE_COLUMNS) + "\n")
    cb.clock = PhaseClock(torch.device("cpu"))
    cb.clock.start()
    trainer = SimpleNamespace(
        global_step=0, log_every_n_steps=50, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    _steps(cb, trainer, 49)
    assert opens == [] and cb.rows_total == 49  # not a logging step yet: nothing opened
    _steps(cb, trainer, 1)
    assert len(opens) == 1
    _steps(cb, trainer, 2 * RECENT_ROWS - 50 + 7)
    cb._finish()
    total = 2 * RECENT_ROWS + 7
    assert len(cb.rows) == RECENT_ROWS and cb.rows_total == total and not cb._pending
    assert len(opens) == total // 50 + 1  # one open per logging step, one at the end
    with real_open(cb.path, newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(1, total + 1))
    rows, seen = cb.rows_since(total - 3)
    assert [r["step"] for r in rows] == [total - 2, total - 1, total] and seen == total
    rows, _ = cb.rows_since(0)  # more than are kept: the latest RECENT_ROWS
    assert len(rows) == RECENT_ROWS and rows[-1]["step"] == total


def test_a_long_logging_interval_still_flushes_a_bounded_buffer(tmp_path):
    cb = Timeline()
    cb.path = tmp_path / "rank-0.csv"
    cb.clock = PhaseClock(torch.device("cpu"))
    cb.clock.start()
    trainer = SimpleNamespace(
        global_step=0, log_every_n_steps=0, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    _steps(cb, trainer, timeline_module.FLUSH_ROWS + 3)
    assert cb.rows_total == timeline_module.FLUSH_ROWS + 3  # CPU times are ready at once
    assert len(cb._pending) == 3 and cb.path.read_text().count("\n") == timeline_module.FLUSH_ROWS
