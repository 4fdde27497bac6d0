"""Error types shared by every layer, and the one formatter of an error line; imports nothing from lit_titan.

``ConfigError`` lives here rather than in ``lit_titan.config`` so that model code
(``models/llama3/hf.py`` refusing a Hugging Face directory) can raise it without importing the
config layer, which itself imports the models: dependencies point one way, down to ``models/``.
"""

from __future__ import annotations

import re


class UserError(ValueError):
    """Bad input the user fixes (a key, a path, a checkpoint of another model): one line, exit code 2.

    The kinds: ``ConfigError`` here, ``LayoutError`` (parallel degrees), ``CheckpointError`` and
    ``ExportError`` in their layers, so that an entry point can refuse all of them by this one type.
    """


class ConfigError(UserError):
    """A configuration that cannot run; the message names the key to change."""


# ``key=value must ...`` (raised below the config layer, which does not know the line's form).
_KEYED = re.compile(
    r"^(?P<kv>[A-Za-z_][\w.\[\]]*=(?:\[[^\]]*\]|\{[^}]*\}|'[^']*'|\S+?))(?P<colon>:?) "
    r"(?P<rest>.*)$",
    re.S,
)


def one_line(err: BaseException | str, *, with_type: bool = False) -> str:
    """``err``'s message on one line, as a terminal or a log grep wants an error: whitespace runs
    collapsed, lines joined by ``"; "`` (by a space after a line that already ends a sentence).

    ``with_type`` puts the exception's class first where it is the information (``OSError: ...``).
    """
    text = ""
    for line in str(err).splitlines():
        line = " ".join(line.split())
        if line:
            text = f"{text}{' ' if text.endswith(('.', ':', ';', ',', '!', '?')) else '; '}{line}" if text else line
    if with_type and isinstance(err, BaseException):
        return f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text


def keyed_line(message: str) -> str:
    """``key=value: what is wrong; what to do``: a message that starts ``key=value must ...`` (ParallelDims,
    the model's arguments, the profiler's windows) gets the colon of that form; others are unchanged."""
    m = _KEYED.match(message)
    return f"{m['kv']}: {m['rest']}" if m and not m["colon"] else message


def error_line(err: BaseException | str) -> str:
    """The line an entry point prints for bad input: ``lit-titan: error: <key>=<value>: <what>; <what to do>``."""
    return f"lit-titan: error: {keyed_line(one_line(err))}"


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
    ``lit_titan.cli.entry.run_entry_point`` exits with ``code``. ``wait_for_parent``: the pid of the
    launcher this rank must outlive no longer (Lightning's launcher: rank 0's exit code is the job's).
    """

    def __init__(self, message: str, code: int = REQUEUE_EXIT_CODE, wait_for_parent: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.wait_for_parent = wait_for_parent


# What a collective raises on the ranks left when a peer dies (gloo; NCCL reports its peer's abort).
# Here, at the bottom, because the checkpoint writer (which must not blame the disk for it) and the
# command line (which prints the one line, lit_titan/observe/peer_exit.py) both ask.
PEER_GONE = (
    "Connection closed by peer",
    "remote worker crashing",
    "Connection reset by peer",
    "NCCL communicator was aborted",
)


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` (or DCP's wrapped cause) is a collective failing because a peer's process is gone."""
    return any(text in str(err) for text in PEER_GONE)


__all__ = [
    "NONFINITE_EXIT_CODE",
    "PEER_GONE",
    "REQUEUE_EXIT_CODE",
    "ConfigError",
    "NonFiniteError",
    "Preempted",
    "UserError",
    "error_line",
    "is_peer_failure",
    "keyed_line",
    "one_line",
]
