"""Seeing inside a run, and what a run may write: step phases, log cadence, throughput and MFU maths,
pre-flight diagnostics, hang dumps, the peer-exit line, the CSV logger, credential redaction.

Import the module that holds a name (``lit_titan.observe.phases``, ...): this file re-exports
nothing, so importing one piece (``redact``, which ``python -m lit_titan.train --help`` needs)
does not import torch through another.
"""
