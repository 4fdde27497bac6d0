"""User-facing toggles (Lightning callbacks); the strategy decides when their transforms run."""

from lit_titan.callbacks.run_summary import RunSummary

__all__ = ["RunSummary"]
