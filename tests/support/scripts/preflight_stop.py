"""A world case: train with ``preflight.action=stop`` and return the one-line verdict it raised.

In-process (tests/support/world.py) rather than a command line: the exit code 2 of the command is
covered by ``test_lit_titan_preflight_command``; this checks a 4-rank job stops before any
training state exists, without four fresh interpreters' imports.
"""

from __future__ import annotations

from typing import Any


def main(argv: list[str]) -> dict[str, Any]:
    from lit_titan.observe.diagnostics import PreflightError
    from lit_titan.train import main as train_main

    try:
        train_main(argv)
    except PreflightError as err:
        return {"stopped": str(err)}
    return {"stopped": None}
