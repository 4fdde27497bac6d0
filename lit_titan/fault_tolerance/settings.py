"""``FaultToleranceConfig``: the ``fault_tolerance`` group, ``TitanStrategy``'s argument, declared once.

Free of torch on purpose: the config schema imports it before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_titan.settings import setting


@dataclass
class FaultToleranceConfig:
    """Replica-group fault tolerance under HSDP (docs/fault_tolerance.md, "Replica groups")."""

    enabled: bool = setting(False)
    # a rank whose heartbeat has not moved for this long is dead (a killed process is seen at once
    # by the broken all-reduce; this bounds the agreement on who is left)
    dead_after_s: float = setting(5.0, gt=0)
