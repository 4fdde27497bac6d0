"""Proof that a job's parallel layout trains to the same numbers as one process: ``lit-titan verify``.

dump.py (what a run computed), compare.py (two runs' dumps), shrink.py (the shrunk copy of a job),
report.py (the verdict and its table), check.py (the procedure; each side's
run is the command lit_titan/cli/verify_side.py), memory.py (will it fit).
"""

from lit_titan.verify.compare import Report, Tolerance, compare, load_dumps, norms
from lit_titan.verify.dump import ParityDump, single_device_name

__all__ = ["ParityDump", "Report", "Tolerance", "compare", "load_dumps", "norms", "single_device_name"]
