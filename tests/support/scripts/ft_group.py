"""One replica group's rank under its own torchrun agent: ``python -m lit_titan.train`` with the parity dump.

Usage (one torchrun per replica group): ft_group.py RUN_DIR [hydra overrides]. It stands in for
``python -m lit_titan.train`` on the torchrun line ``lit-titan launch`` prints under fault tolerance
(docs/fault_tolerance.md, "Launching one torchrun per replica group") and adds what the test reads: the
parity dump (``parity.train_case``) in ``RUN_DIR/dump`` for replica group 0 (where ``parity.check_case``
reads it), ``RUN_DIR/dump-replica<r>`` for group r, with ``-restart<A>`` appended in the agent's restart A
(its ``TORCHELASTIC_RESTART_COUNT``), and a record of this start beside it, ``start-rank-<R>.json``. Ends like the train command
(``run_entry_point``, lit_titan/job/ranks.py ``exit_rank``), so a finished rank does not abort in gloo's teardown.
"""

import json
import os
import sys
from pathlib import Path

from lit_titan.cli.entry import run_entry_point
from lit_titan.cli.train import user_errors

if __name__ == "__main__":
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    replica = next(int(a.split("=")[1]) for a in sys.argv if a.startswith("fault_tolerance.replica_id="))
    out = Path(sys.argv[1]) / ("dump" if replica == 0 else f"dump-replica{replica}")
    out = out.with_name(out.name + (f"-restart{attempt}" if attempt else ""))
    out.mkdir(parents=True, exist_ok=True)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
    record = {"pid": os.getpid(), "agent_pid": os.getppid(), **{k: os.environ[k] for k in keys}}
    (out / f"start-rank-{os.environ['RANK']}.json").write_text(json.dumps(record))
    from parity import DUMP_STEPS, train_case

    run_entry_point(lambda: train_case(sys.argv[2:], str(out), DUMP_STEPS), user_errors, rank_failures=True)
