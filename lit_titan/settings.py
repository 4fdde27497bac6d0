"""How a component declares a config key: ``setting(default, ge=1, choices=...)`` on a dataclass field.

A component's settings dataclass (e.g. ``strategies.settings.ParallelConfig``) is both its Python
argument and its group in the config schema (``config/schema.py`` imports it), so a key is declared
once, beside the code that reads it. Kept here, below every package and free of torch, because the
schema is checked before anything heavy is imported (``--help``, one-line errors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, field
from typing import Any


def setting(
    default: Any = MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    allow: Sequence[Any] = (),
) -> Any:
    """A field with its rule: bounds (``ge``/``gt``/``le``/``lt``), ``choices``, or ``check(value)``
    returning what is wrong (None: fine). ``allow``: extra values accepted outside the bounds
    (``dp_shard=-1``). None passes every rule (the field's ``Optional[...]`` type decides whether null
    is allowed). A list or dict default is given as a zero-argument factory."""
    rule = {
        k: v
        for k, v in dict(
            ge=ge, gt=gt, le=le, lt=lt, choices=tuple(choices) if choices else None, check=check, allow=tuple(allow)
        ).items()
        if v not in (None, ())
    }
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})
