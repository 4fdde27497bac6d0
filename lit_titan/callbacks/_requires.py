"""Shared check: callbacks that ask the strategy for transforms need a TitanStrategy."""

from __future__ import annotations

from typing import Any

from lit_titan.strategies.contract import StrategyContract, contract


def transform_strategy(trainer: Any, feature: str) -> StrategyContract:
    """The trainer's strategy if it can run transforms, else a clear error naming the fix."""
    strategy = contract(trainer.strategy)
    if not strategy.runs_transforms:
        raise TypeError(
            f"{feature} needs lit_titan.TitanStrategy (it applies the transform in its fixed order); "
            f"got {type(trainer.strategy).__name__}. Use Trainer(strategy=TitanStrategy(...)) or the lit-titan CLI."
        )
    return strategy
