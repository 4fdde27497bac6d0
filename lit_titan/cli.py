"""``lit-titan <command> [overrides]``: dispatches to ``python -m lit_titan.<command>``.

Exec'ing the module (rather than importing it) keeps ``sys.argv`` in the form Lightning's
process launcher re-runs for the other ranks.
"""

from __future__ import annotations

import os
import sys

COMMANDS = {"train": "lit_titan.train", "plan": "lit_titan.plan", "launch": "lit_titan.launch",
            "export": "lit_titan.export"}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: lit-titan {{{','.join(COMMANDS)}}} [arguments...]", file=sys.stderr)
        sys.exit(2)
    os.execv(sys.executable, [sys.executable, "-m", COMMANDS[argv[0]], *argv[1:]])


if __name__ == "__main__":
    main()
