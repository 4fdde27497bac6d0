"""``lit-titan <command> [arguments]``: the one command table, and the dispatch to ``python -m <module>``.

Exec'ing the command's module (rather than importing it) keeps ``sys.argv`` in the form Lightning's
process launcher re-runs for the other ranks. ``train`` runs ``lit_titan.train``, the module every
launcher (Lightning, torchrun, srun) starts on each rank; the others run their own file in cli/.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

__all__ = ["COMMANDS", "Command", "cli_help", "main"]


class Command(NamedTuple):
    module: str  # run as ``python -m <module>``
    summary: str  # its line in ``lit-titan --help``


COMMANDS: dict[str, Command] = {
    "train": Command("lit_titan.train", "train a Llama under any parallel layout (Hydra overrides; -m sweeps)"),
    "verify": Command(
        "lit_titan.cli.verify",
        "prove a layout equal to one process on a shrunk copy of the job (float64, per parameter)",
    ),
    "prepare": Command(
        "lit_titan.cli.prepare", "tokenize your text once into token shards (data=text data.path=DIR out=DIR)"
    ),
    "plan": Command(
        "lit_titan.cli.plan",
        "dry-run a layout for a cluster profile: memory, step time, MFU bound; search=true ranks layouts",
    ),
    "launch": Command(
        "lit_titan.cli.launch", "print (--dry-run) or run the torchrun / Slurm command for a cluster profile"
    ),
    "store": Command(
        "lit_titan.cli.store", "host the job's store for one launch per replica group (fault_tolerance.store)"
    ),
    "export": Command("lit_titan.cli.export", "turn a checkpoint into a Hugging Face Llama directory"),
    "report": Command(
        "lit_titan.cli.report", "write RUN_DIR/report.html: loss, throughput, per-rank timeline, checkpoints"
    ),
    "preflight": Command(
        "lit_titan.cli.preflight",
        "burn-in and bandwidth test of every rank, mesh group and "
        "intra-/inter-node group; names slow ranks/links (train's "
        "overrides)",
    ),
}


def cli_help() -> str:
    """``lit-titan --help``: every subcommand with one line (the per-command help, generated from
    ``conf/``, is ``usage.py``'s, which reads this table: the import goes one way)."""
    width = max(map(len, COMMANDS))
    return "\n".join(
        [
            "usage: lit-titan COMMAND [arguments...]   (lit-titan COMMAND --help: that command's options)",
            "",
            "commands:",
            *(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()),
            "",
            'Start: python -m lit_titan.train trainer.max_steps=20; README.md, section "First hour".',
        ]
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(cli_help(), file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        sys.exit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    os.execv(sys.executable, [sys.executable, "-m", COMMANDS[argv[0]].module, *argv[1:]])
