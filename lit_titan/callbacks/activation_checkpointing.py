"""Activation checkpointing of transformer blocks: none, full, selective per-op, every N layers.

The transform is ``lit_titan.strategies.transforms.request_activation_checkpointing``; this callback asks for it.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lit_titan.callbacks._requires import transform_strategy
from lit_titan.callbacks.settings import ActivationCheckpointingConfig
from lit_titan.settings import settings_of
from lit_titan.strategies.transforms import MODES, request_activation_checkpointing

__all__ = ["MODES", "ActivationCheckpointing"]


class ActivationCheckpointing(L.Callback):
    """Trade compute for memory per transformer block; applied by the strategy after TP/CP and
    before compile and FSDP (so each checkpointed block is compiled and sharded as one unit)."""

    def __init__(self, settings: ActivationCheckpointingConfig | None = None, **keys: Any) -> None:
        """``settings`` or its fields by name (``mode="full"``): ``callbacks/settings.py``."""
        s = self.settings = settings_of(ActivationCheckpointingConfig, settings, keys)
        if s.mode not in MODES:
            raise ValueError(f"unknown activation checkpointing mode {s.mode!r}; choose one of {MODES}")
        if s.every_n_layers < 1:
            raise ValueError("every_n_layers must be >= 1")
        self.mode, self.every_n_layers = s.mode, s.every_n_layers
        self._registered = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = transform_strategy(trainer, "ActivationCheckpointing")
        if not self._registered:
            request_activation_checkpointing(strategy, self.mode, self.every_n_layers)
            self._registered = True
