"""Error types shared by every layer; this module imports nothing from lit_titan.

``ConfigError`` lives here rather than in ``lit_titan.config`` so that model code
(``models/llama3/hf.py`` refusing a Hugging Face directory) can raise it without importing the
config layer, which itself imports the models: dependencies point one way, down to ``models/``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key to change."""


# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry". Not 0 (a scheduler
# reads 0 as done), not 1 (a failure), not 2 (bad input), not 128+N (killed before saving).
REQUEUE_EXIT_CODE = 75


class Preempted(Exception):
    """The run saved its work and stops to be requeued (a signal, a data-store outage).

    Raised on every rank together after the save (``lit_titan/callbacks/preemption.py``);
    ``lit_titan.cli.run_entry_point`` exits with ``code``. ``wait_for_parent``: the pid of the
    launcher this rank must outlive no longer (Lightning's launcher: rank 0's exit code is the job's).
    """

    def __init__(self, message: str, code: int = REQUEUE_EXIT_CODE, wait_for_parent: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.wait_for_parent = wait_for_parent


__all__ = ["ConfigError", "Preempted", "REQUEUE_EXIT_CODE"]
