"""``python -m lit_titan.train [hydra overrides]``: the module every launcher starts on each rank.

Lightning's launcher, torchrun and srun re-run this module by name, so it stays at the top and
holds ``main()`` only; the command is lit_titan/cli/train.py, the run lit_titan/job/.
"""

from __future__ import annotations

from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The train command (``lit_titan.cli.train.main``): from Python and notebooks, a list of overrides."""
    from lit_titan.cli.train import main as train_command

    return train_command(argv)


if __name__ == "__main__":
    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import user_errors

    run_entry_point(main, user_errors, rank_failures=True)
