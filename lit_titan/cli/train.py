"""``lit-titan train`` / ``python -m lit_titan.train``: the Hydra app around one run (lit_titan/job/run.py).

The app (cli/hydra_app.py) parses the command line like ``@hydra.main``: one run, a ``-m`` sweep,
``--cfg``, ``--info`` or ``--help``; each run is ``lit_titan.job.run.train``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["main", "user_errors"]


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix your input" (or, PreflightError, "fix your fleet"): one line, no traceback, exit code 2.

    A function, not a constant: their modules import torch and Lightning, which ``--help`` must not wait for.
    """
    from lit_titan.checkpoint import CheckpointError
    from lit_titan.config import ConfigError
    from lit_titan.observe.diagnostics import PreflightError
    from lit_titan.strategies.parallel_dims import LayoutError

    return (ConfigError, LayoutError, FileNotFoundError, CheckpointError, PreflightError)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """One run, a ``-m`` sweep, ``--cfg``, ``--info`` or ``--help``.

    Callable from Python and notebooks with a list of overrides; returns the run summary ({} for a
    sweep or a display command).
    """
    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.run import train

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_app(argv, train)
