"""Shared check: callbacks that ask the strategy for transforms need a TitanStrategy."""

from __future__ import annotations

from typing import Any


def transform_strategy(trainer: Any, feature: str) -> Any:
    """The trainer's strategy if it can run transforms, else a clear error naming the fix."""
    strategy = trainer.strategy
    if not hasattr(strategy, "register_transform"):
        raise TypeError(f"{feature} needs lit_titan.TitanStrategy (it applies the transform in its fixed order); "
                        f"got {type(strategy).__name__}. Use Trainer(strategy=TitanStrategy(...)) or the lit-titan CLI.")
    return strategy
