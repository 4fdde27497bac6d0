"""torchrun job whose rank 1 raises mid-run: every rank goes through lit-titan's entry-point wrapper.

Rank 0 waits in a gloo barrier that rank 1 never reaches; rank 1 raises. The wrapper turns rank 1's
exception into one line naming the rank and its traceback file; torchrun's agent then ends rank 0.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from lit_titan.cli.entry import run_entry_point


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("simulated failure on this rank (e.g. an I/O error)")
    dist.barrier()  # never completes: rank 1 is gone; torchrun tears this rank down


if __name__ == "__main__":
    os.environ.setdefault("LIT_TITAN_RUN_DIR", os.getcwd())
    run_entry_point(main, (), rank_failures=True)
