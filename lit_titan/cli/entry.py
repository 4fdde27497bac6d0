"""Every command's exit-code contract: bad input is one line and exit code 2, a rank's failure one line and 1.

Each ``lit_titan/cli/<command>.py`` (and ``python -m lit_titan.train``) runs its ``main`` through
``run_entry_point``; the reporting itself is lit_titan/job/ranks.py, which a run uses without a command.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from lit_titan.errors import Preempted, is_peer_failure
from lit_titan.job.ranks import (
    exit_rank,
    is_rank_of_a_job,
    job_rank,
    report_peer_failure,
    report_rank_failure,
    report_user_error,
    wait_for_parent,
)

__all__ = ["run_entry_point"]


def run_entry_point(
    main: Callable[[], Any],
    user_errors: tuple[type[BaseException], ...] | Callable[[], tuple[type[BaseException], ...]],
    rank_failures: bool = False,
) -> None:
    """Run an entry point's ``main``; an error in the user's input is one line and exit code 2.

    An exception with an ``exit_code`` (a stop every rank decided on, e.g. ``NonFiniteError``) is
    one line and that code.

    ``user_errors``: the exception types, or a function returning them, called only when ``main``
    raises (their modules may be slow to import, and ``--help`` should not wait for them).

    ``rank_failures``: in a job of several processes, any other exception is one line naming the rank
    and the file holding its traceback (``report_rank_failure``), exit code 1. ``HYDRA_FULL_ERROR=1``
    (Hydra's own switch) shows the traceback instead.
    """
    try:
        main()
    except Preempted as err:  # saved and said (lit_titan/callbacks/preemption.py): the requeue exit code
        if err.wait_for_parent is not None:
            wait_for_parent(err.wait_for_parent)
        _exit(err.code, rank_failures)
    except user_errors() if callable(user_errors) else user_errors as err:  # noqa: B030 - a tuple of classes
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        report_user_error(err)
        _exit(2, rank_failures)
    except Exception as err:  # noqa: BLE001 - a runtime failure (OOM, collective timeout, I/O) on some rank
        code = getattr(err, "exit_code", None)  # a stop the run decided on (lit_titan.errors.NonFiniteError)
        if isinstance(code, int) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            report_user_error(err)
            _exit(code, rank_failures)
        if rank_failures and is_peer_failure(err) and os.environ.get("HYDRA_FULL_ERROR") != "1" and is_rank_of_a_job():
            report_peer_failure()  # a peer's process ended: name it, not this rank's collective that failed
            _exit(1, rank_failures)
        if not rank_failures or os.environ.get("HYDRA_FULL_ERROR") == "1" or job_rank() is None:
            raise  # one process: the traceback, as Python prints it
        report_rank_failure(err)
        _exit(1, rank_failures)
    _exit(0, rank_failures)


def _exit(code: int, launched_job: bool) -> None:
    """``sys.exit(code)``; a rank of a multi-process job skips interpreter teardown (``exit_rank``)."""
    if launched_job and is_rank_of_a_job():
        exit_rank(code)
    if code:
        sys.exit(code)
