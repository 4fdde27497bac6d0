"""A world case: train, and return the ``NonFiniteError`` line the run stopped with (None if it finished).

In-process (tests/support/world.py): the command line's part (that line, exit code 3) is
``test_nonfinite_error_is_one_line_and_exit_code_3``; a case that raised would tear the world down.
"""

from __future__ import annotations

from typing import Any


def main(argv: list[str]) -> dict[str, Any]:
    from lit_titan.errors import NonFiniteError
    from lit_titan.train import main as train_main

    try:
        train_main(argv)
    except NonFiniteError as err:
        return {"stopped": str(err)}
    return {"stopped": None}
