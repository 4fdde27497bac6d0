"""Replica-group fault tolerance for HSDP: lose a whole replica group, keep training, lose no sample.

``shares.py`` says which samples of a step's global batch each live replica trains and how its
gradient is weighted; ``membership.py`` is the heartbeat and the agreement on who is alive (a
TCPStore); ``cross_replica.py`` the cross-replica process group, rebuilt per membership;
``transfer.py`` what a rejoining group receives from a live peer; ``events.py`` the log line and
``run_dir`` row of a change; ``replicas.py`` the step protocol that ties them together. Why not torchft: docs/fault_tolerance.md ("Replica groups").
"""

from lit_titan.fault_tolerance.membership import ReplicaExcluded
from lit_titan.fault_tolerance.replicas import ReplicaGroups, ReplicaLost

__all__ = ["ReplicaExcluded", "ReplicaGroups", "ReplicaLost"]
