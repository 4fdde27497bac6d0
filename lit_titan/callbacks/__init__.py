"""User-facing toggles (Lightning callbacks); the strategy decides when their transforms run.

The callbacks load lazily (PEP 562): the config schema imports the torch-free ``callbacks.settings``
before torch and Lightning are loaded, and importing a submodule runs this file first.
"""

import importlib
from typing import Any

_HOMES = {
    "ActivationCheckpointing": "activation_checkpointing",
    "Checkpointing": "checkpointing",
    "Compile": "compile",
    "FaultInjection": "fault_injection",
    "Float8": "float8",
    "KnownNormCheck": "known_norm",
    "NonFiniteError": "nonfinite",
    "NonFiniteGuard": "nonfinite",
    "Profiler": "profiler",
    "ReplicaDivergenceCheck": "replica_check",
    "RunSummary": "run_summary",
    "StepProgressBar": "progress",
    "StragglerReport": "straggler",
    "ThroughputMonitor": "throughput",
    "Timeline": "timeline",
    "WATCHDOG_EXIT_CODE": "settings",
    "Watchdog": "watchdog",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
