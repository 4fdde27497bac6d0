"""User-facing toggles (Lightning callbacks); the strategy decides when their transforms run."""

from lit_titan.callbacks.activation_checkpointing import ActivationCheckpointing
from lit_titan.callbacks.checkpointing import Checkpointing
from lit_titan.callbacks.compile import Compile
from lit_titan.callbacks.fault_injection import FaultInjection
from lit_titan.callbacks.float8 import Float8
from lit_titan.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from lit_titan.callbacks.profiler import Profiler
from lit_titan.callbacks.progress import StepProgressBar
from lit_titan.callbacks.run_summary import RunSummary
from lit_titan.callbacks.straggler import StragglerReport
from lit_titan.callbacks.throughput import ThroughputMonitor
from lit_titan.callbacks.timeline import Timeline
from lit_titan.callbacks.watchdog import WATCHDOG_EXIT_CODE, Watchdog

__all__ = [
    "ActivationCheckpointing",
    "Checkpointing",
    "Compile",
    "FaultInjection",
    "Float8",
    "NonFiniteError",
    "NonFiniteGuard",
    "Profiler",
    "RunSummary",
    "StepProgressBar",
    "StragglerReport",
    "ThroughputMonitor",
    "Timeline",
    "WATCHDOG_EXIT_CODE",
    "Watchdog",
]
