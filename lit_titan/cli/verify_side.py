"""``python -m lit_titan.cli.verify_side RUN_DIR STEPS KNOWN_NORM_STEP OVERRIDES...``: one side of ``lit-titan
verify``: the training entry point with the dump, the known-norm check and the replica check.

Its own module so that Lightning's launcher re-runs it for every rank; ``lit_titan/verify/check.py`` starts it.
The same ``run_side`` runs in the tests' reused process worlds, so what the tests prove is what the command
runs. ``STEPS``: comma-separated steps to dump; ``KNOWN_NORM_STEP``: a step, or ``-``.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

from lit_titan.verify.dump import CHECKS_FILE, DUMP_DIR, ParityDump

__all__ = ["main", "run_side"]


def run_side(argv: list[str], run_dir: str, steps: list[int], known_norm_step: int | None) -> dict[str, Any]:
    """Train ``argv`` into ``run_dir``, dumping ``steps``; with ``known_norm_step``, that step's gradients are set
    to ones for the known-norm check and every step's replicated state is compared across its copies.

    Rank 0 writes ``run_dir/checks.json`` (the known norm, the replica findings). Returns the run summary.
    """
    from lit_titan.callbacks.known_norm import KnownNormCheck
    from lit_titan.callbacks.replica_check import ReplicaDivergenceCheck
    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.ranks import is_launcher_rank_zero
    from lit_titan.job.run import train

    out = Path(run_dir)
    callbacks: list[Any] = [ParityDump(out / DUMP_DIR, steps, reductions=known_norm_step is not None)]
    known = replicas = None
    if known_norm_step is not None:  # after the dumps: the known-norm step trains on ones
        known = KnownNormCheck(step=known_norm_step)
        replicas = ReplicaDivergenceCheck(every_n_steps=1, action="record")
        callbacks += [known, replicas]
    summary = run_app([*argv, f"run_dir={out}"], partial(train, callbacks=callbacks))
    if is_launcher_rank_zero():
        checks: dict[str, Any] = {}
        if known is not None:
            checks["known_norm"] = {"expected": known.expected, "measured": known.measured}
        if replicas is not None:
            checks["replicas"] = {"divergent": replicas.divergent, "checked": replicas.checked}
        (out / CHECKS_FILE).write_text(json.dumps(checks, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    run_dir, steps, known, *overrides = list(sys.argv[1:] if argv is None else argv)
    run_side(overrides, run_dir, [int(s) for s in steps.split(",")], None if known == "-" else int(known))


if __name__ == "__main__":
    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import user_errors

    run_entry_point(main, user_errors, rank_failures=True)
