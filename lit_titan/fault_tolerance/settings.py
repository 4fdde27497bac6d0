"""``FaultToleranceConfig``: the ``fault_tolerance`` group, ``TitanStrategy``'s argument, declared once.

Free of torch on purpose: the config schema imports it before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_titan.settings import setting


def host_port(value: Any) -> str | None:
    """``HOST:PORT`` (a store's address), or what is wrong with it."""
    host, _, port = str(value).rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return None
    return "not HOST:PORT; give the address the store listens on, e.g. node0:29600 (lit-titan store prints it)"


@dataclass
class FaultToleranceConfig:
    """Replica-group fault tolerance under HSDP (docs/fault_tolerance.md, "Replica groups")."""

    enabled: bool = setting(False)
    # a rank whose heartbeat has not moved for this long is dead (a killed process is seen at once
    # by the broken all-reduce; this bounds the agreement on who is left)
    dead_after_s: float = setting(5.0, gt=0)
    # One launch (torchrun agent, srun step) per replica group: this launch's group, so the launcher that
    # restarts a dead group restarts it alone. None: one launch for the whole job (the job rank says).
    replica_id: int | None = setting(None, ge=0)
    # The job's store (HOST:PORT, `lit-titan store`), hosted outside every group so it outlives them.
    # None: MASTER_ADDR:MASTER_PORT (one launch for the whole job; a per-group torchrun's is its own).
    store: str | None = setting(None, check=host_port)
