"""The command line, or a list of overrides, turned into one checked ``JobSpec``.

``compose`` (Hydra, ``conf/``) -> ``schema`` (each key's type and range; choices imported from the
modules that own them) + ``schema_check`` (the checker) -> ``rules`` (keys that constrain each other,
one function each) -> ``inputs`` (what the config points at: data, tokenizer, ``run_dir``, FP8) ->
``spec`` (``validate(cfg) -> JobSpec``, the one check and the one derivation of the batch layout).
"""

from lit_titan.config.compose import compose, conf_dir, to_yaml
from lit_titan.config.spec import JobSpec, validate
from lit_titan.errors import ConfigError

__all__ = ["ConfigError", "JobSpec", "compose", "conf_dir", "to_yaml", "validate"]
