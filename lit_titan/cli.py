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
            "launch": "lit_titan.launch", "export": "lit_titan.export", "report": "lit_titan.report",
            "preflight": "lit_titan.preflight"}


def run_entry_point(main: Callable[[], Any], user_errors: tuple[type[BaseException], ...]) -> None:
    """Run an entry point's ``main``; an error in the user's input is one line and exit code 2."""
    try:
        main()
    except user_errors as err:
        # An error every rank of the job raised together (e.g. a failed checkpoint save, agreed
        # collectively) is printed once, by the launcher's rank 0.
        if not (getattr(err, "raised_on_every_rank", False) and not is_launcher_rank_zero()):
            print(f"lit-titan: error: {err}", file=sys.stderr)
        sys.exit(2)


def is_launcher_rank_zero() -> bool:
    """Rank 0 of the job under torchrun, Lightning's launcher, or Slurm/submitit tasks (SLURM_PROCID)."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        from lit_titan.usage import cli_help  # every subcommand with one line

        print(cli_help(), file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        sys.exit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    os.execv(sys.executable, [sys.executable, "-m", COMMANDS[argv[0]], *argv[1:]])


if __name__ == "__main__":
    main()
