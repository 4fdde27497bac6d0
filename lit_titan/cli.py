"""``lit-titan <command> [overrides]``: dispatches to ``python -m lit_titan.<command>``.

Exec'ing the module (rather than importing it) keeps ``sys.argv`` in the form Lightning's
process launcher re-runs for the other ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

COMMANDS = {"train": "lit_titan.train", "prepare": "lit_titan.prepare", "plan": "lit_titan.plan",
            "launch": "lit_titan.launch", "export": "lit_titan.export", "report": "lit_titan.report"}


def run_entry_point(main: Callable[[], Any], user_errors: tuple[type[BaseException], ...]) -> None:
    """Run an entry point's ``main``; an error in the user's input is one line and exit code 2.

    ``HYDRA_FULL_ERROR=1`` (Hydra's own switch) shows the traceback instead.
    """
    try:
        main()
    except user_errors as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        report_user_error(err)
        sys.exit(2)


def report_user_error(err: BaseException) -> None:
    """``lit-titan: error: <message>`` on one line (stderr).

    An error every rank of the job raises together (a bad config, missing data, a failed
    checkpoint save agreed collectively: ``raised_on_every_rank``) is printed once, by the
    launcher's rank 0, not once per rank.
    """
    if getattr(err, "raised_on_every_rank", False) and not is_launcher_rank_zero():
        return
    print(f"lit-titan: error: {one_line(err)}", file=sys.stderr, flush=True)


def one_line(err: BaseException | str) -> str:
    """A message as one line: its lines joined with '; ' (a terminal or a log grep sees one line per error)."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def is_launcher_rank_zero() -> bool:
    """Rank 0 of the job under torchrun, Lightning's launcher, or Slurm/submitit tasks (SLURM_PROCID)."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: lit-titan {{{','.join(COMMANDS)}}} [arguments...]", file=sys.stderr)
        sys.exit(2)
    os.execv(sys.executable, [sys.executable, "-m", COMMANDS[argv[0]], *argv[1:]])


if __name__ == "__main__":
    main()
