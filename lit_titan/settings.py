"""How a component declares a config key: ``setting(default, ge=1, choices=...)`` on a dataclass field.

A component's settings dataclass (e.g. ``strategies.settings.ParallelConfig``) is both its Python
argument and its group in the config schema (``config/schema.py`` imports it), so a key is declared
once, beside the code that reads it. Kept here, below every package and free of torch, because the
schema is checked before anything heavy is imported (``--help``, one-line errors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, field, replace
from typing import Any, TypeVar

T = TypeVar("T")


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


def settings_of(cls: type[T], settings: T | None, keys: dict[str, Any]) -> T:
    """A component's settings: ``settings`` (None: ``cls``'s defaults) with ``keys`` over it, each a field
    given by name, as Hydra's ``_target_`` instantiation and the Python API pass them (``_target_`` is
    Hydra's and dropped). A name that is no field is a TypeError naming it, as a constructor's would be."""
    keys = {k: v for k, v in keys.items() if k != "_target_"}
    return replace(settings if settings is not None else cls(), **keys)


# Checks several groups share (``setting(check=...)``): what is wrong and what to give instead, or None.
def non_empty_str(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "empty or not a string; give a non-empty string"


def path_or_null(value: Any) -> str | None:
    return None if value is None or isinstance(value, str) else "not a path; give a path (a string) or null"
