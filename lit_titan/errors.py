"""Error types shared by every layer; this module imports nothing from lit_titan.

``ConfigError`` lives here rather than in ``lit_titan.config`` so that model code
(``models/llama3/hf.py`` refusing a Hugging Face directory) can raise it without importing the
config layer, which itself imports the models: dependencies point one way, down to ``models/``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key to change."""


__all__ = ["ConfigError"]
