"""torch.compile per transformer block (TorchTitan's granularity: small graphs, fast recompiles)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lit_titan.callbacks._requires import transform_strategy
from lit_titan.callbacks.settings import CompileConfig
from lit_titan.settings import settings_of
from lit_titan.strategies.transforms import request_compile


class Compile(L.Callback):
    """Compile each block in place (``lit_titan.strategies.transforms.request_compile``).

    Applied by the strategy after TP and activation checkpointing and before FSDP; ``compile_loss``
    also compiles the module's ``compute_loss``.
    """

    def __init__(self, settings: CompileConfig | None = None, **keys: Any) -> None:
        """``settings`` or its fields by name (``backend="eager"``): ``callbacks/settings.py``."""
        s = self.settings = settings_of(CompileConfig, settings, keys)
        self.fullgraph, self.backend, self.mode, self.compile_loss = s.fullgraph, s.backend, s.mode, s.compile_loss
        self._registered = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = transform_strategy(trainer, "Compile")
        if not self._registered:
            request_compile(strategy, fullgraph=self.fullgraph, backend=self.backend, mode=self.mode)
            if self.compile_loss and hasattr(pl_module, "compute_loss"):
                pl_module.compute_loss = torch.compile(pl_module.compute_loss, backend=self.backend)
            self._registered = True
