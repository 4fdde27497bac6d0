"""Replica-group fault tolerance for HSDP: lose a whole replica group, keep training, lose no sample.

``shares.py`` says which samples of a step's global batch each live replica trains and how its
gradient is weighted; ``membership.py`` is the heartbeat and the agreement on who is alive (a
TCPStore); ``cross_replica.py`` the cross-replica process group, rebuilt per membership;
``transfer.py`` what a rejoining group receives from a live peer; ``events.py`` the log line and
``run_dir`` row of a change; ``replicas.py`` the step protocol that ties them together;
``lightning_step.py`` the same protocol inside ``TitanStrategy``'s training step; ``settings.py`` the
``fault_tolerance`` keys. Why not torchft: docs/fault_tolerance.md ("Replica groups").

The names below load lazily: the config schema imports ``settings.py`` without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReplicaExcluded", "ReplicaGroups", "ReplicaLost"]


def __getattr__(name: str) -> Any:
    if name == "ReplicaExcluded":
        from lit_titan.fault_tolerance.membership import ReplicaExcluded

        return ReplicaExcluded
    if name in ("ReplicaGroups", "ReplicaLost"):
        from lit_titan.fault_tolerance import replicas

        return getattr(replicas, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
