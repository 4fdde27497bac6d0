"""Error types shared by every layer; this module imports nothing from lit_titan.

``ConfigError`` lives here rather than in ``lit_titan.config`` so that model code
(``models/llama3/hf.py`` refusing a Hugging Face directory) can raise it without importing the
config layer, which itself imports the models: dependencies point one way, down to ``models/``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key to change."""


# The exit code of a run stopped by a NaN/Inf loss, gradient norm or checkpoint state. Not 1 (a
# crash: a launcher's restart may help) nor 2 (bad input, refused before any work) nor the hang
# watchdog's 75 (EX_TEMPFAIL): restarting a diverged run from its last checkpoint with the same
# settings diverges again, so a scheduler or script should not requeue on this code.
NONFINITE_EXIT_CODE = 3


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or state; the run stops (``NONFINITE_EXIT_CODE``).

    Here rather than in the guard's module so the checkpoint writer, which refuses to publish a
    non-finite state, raises the same error without importing the callbacks.
    """

    exit_code = NONFINITE_EXIT_CODE
    raised_on_every_rank = True  # every rank reaches the same decision: the command line prints it once


__all__ = ["NONFINITE_EXIT_CODE", "ConfigError", "NonFiniteError"]
