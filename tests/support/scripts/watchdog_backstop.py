"""Start a Watchdog, then hold the GIL forever: only its C-level faulthandler backstop can fire.

Usage: watchdog_backstop.py RUN_DIR   (expected: stacks on stderr, exit status 1, in ~2 s)
"""

import re
import sys
import time
from types import SimpleNamespace

from lit_titan.callbacks import Watchdog


def spin_holding_the_gil() -> None:
    # Catastrophic backtracking: the regex engine runs in C and never releases the GIL.
    re.match(r"(a+)+$", "a" * 64 + "b")


if __name__ == "__main__":
    dog = Watchdog(timeout_s=1.0, backstop_s=1.0, poll_interval_s=0.1, run_dir=sys.argv[1])
    dog.on_train_start(SimpleNamespace(global_rank=0, default_root_dir=sys.argv[1], global_step=0), None)
    time.sleep(0.3)  # the thread arms the backstop on its first polls
    spin_holding_the_gil()
