"""A membership change, as one log line and one row of ``run_dir/membership.csv``."""

from __future__ import annotations

import csv
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FILE = "membership.csv"


@dataclass(frozen=True)
class MembershipChange:
    step: int
    epoch: int
    event: str  # "left" or "joined"
    replicas: str  # the replica groups that left or joined, e.g. "1" or "1 2"
    ranks: str  # their global ranks
    members: str  # replica groups training after the change
    detect_s: float  # from the cross-replica all-reduce's start to its failure
    agree_s: float  # the membership agreement (waiting out the dead ranks' heartbeats)
    rebuild_s: float  # the new cross-replica process group
    transfer_s: float = 0.0  # a joining group's weights and optimizer state from a live peer

    def line(self) -> str:
        if self.event == "joined":
            return (
                f"lit-titan: replica group {self.replicas} (ranks {self.ranks}) joined at step {self.step} with "
                f"a live peer's weights and optimizer state; replica groups {self.members} train "
                f"(regroup {self.rebuild_s:.2f} s, state transfer {self.transfer_s:.2f} s)"
            )
        return (
            f"lit-titan: replica group {self.replicas} (ranks {self.ranks}) left at step {self.step}; "
            f"replica groups {self.members} train its samples (detected {self.detect_s:.2f} s, "
            f"membership {self.agree_s:.2f} s, regroup {self.rebuild_s:.2f} s)"
        )


def record(change: MembershipChange, run_dir: str | Path | None) -> None:
    """Print the line (stderr) and append the row; called by one rank per change."""
    print(change.line(), file=sys.stderr, flush=True)
    if run_dir is None:
        return
    path = Path(run_dir) / FILE
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(MembershipChange)])
        if new:
            writer.writeheader()
        row = asdict(change)
        writer.writerow({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
