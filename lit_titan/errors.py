"""Error types shared by every layer; this module imports nothing from lit_titan.

``ConfigError`` lives here rather than in ``lit_titan.config`` so that model code
(``models/llama3/hf.py`` refusing a Hugging Face directory) can raise it without importing the
config layer, which itself imports the models: dependencies point one way, down to ``models/``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key to change."""


# The exit code of a run stopped by a NaN/Inf loss, gradient norm or checkpoint state. Not 1 (a
# crash: a launcher's restart may help) nor 2 (bad input, refused before any work) nor the hang
# watchdog's 75 (EX_TEMPFAIL): restarting a diverged run from its last checkpoint with the same
# settings diverges again, so a scheduler or script should not requeue on this code.
NONFINITE_EXIT_CODE = 3


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or state; the run stops (``NONFINITE_EXIT_CODE``).

    Here rather than in the guard's module so the checkpoint writer, which refuses to publish a
    non-finite state, raises the same error without importing the callbacks.
    """

    exit_code = NONFINITE_EXIT_CODE
    raised_on_every_rank = True  # every rank reaches the same decision: the command line prints it once


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


# What a collective raises on the ranks left when a peer dies (gloo; NCCL reports its peer's abort).
# Here, at the bottom, because the checkpoint writer (which must not blame the disk for it) and the
# command line (which prints the one line, lit_titan/observe/peer_exit.py) both ask.
PEER_GONE = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
             "NCCL communicator was aborted")


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` (or DCP's wrapped cause) is a collective failing because a peer's process is gone."""
    return any(text in str(err) for text in PEER_GONE)


__all__ = ["NONFINITE_EXIT_CODE", "PEER_GONE", "REQUEUE_EXIT_CODE", "ConfigError", "NonFiniteError", "Preempted",
           "is_peer_failure"]
