"""The CSV logger that writes ``${run_dir}/metrics.csv``, into a run directory the run itself created.

Why not Lightning's ``CSVLogger`` as is: its writer warns "Experiment logs directory ... exists and
is not empty. Previous log files ... will be deleted" whenever the directory holds any file. A
lit-titan run directory always does before the logger starts (Hydra's ``.hydra/`` record and
``config.yaml`` are written first, so that a failing run still says what it was), so the warning
was always printed and always false. The only file the writer deletes is ``metrics.csv``; this
writer warns exactly when that file is there (a new run in an old run_dir: act on it), and a resumed
run has moved its metrics aside before (``train.archive_metrics``).
"""

from __future__ import annotations

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

__all__ = ["RunDirCSVLogger"]


class _RunDirWriter(ExperimentWriter):
    # Overrides Lightning's private check (lightning 2.6: fabric.loggers.csv_logs._ExperimentWriter),
    # which the writer's __init__ calls; the rest of the writer is Lightning's.
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            rank_zero_warn(
                f"{self.metrics_file_path} exists from an earlier run and will be replaced; pass a new "
                f"run_dir= to keep it, or resume=auto to continue that run"
            )
            self._fs.rm_file(self.metrics_file_path)


class RunDirCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` (same files, same format) without the false "directory not empty" warning."""

    @property
    def experiment(self) -> ExperimentWriter:
        # Only global rank 0 writes; the parent's property (rank_zero_experiment) hands the others a dummy.
        if self._experiment is None and getattr(rank_zero_only, "rank", 0) == 0:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _RunDirWriter(log_dir=self.log_dir)
        return super().experiment
