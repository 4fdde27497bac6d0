"""torch.compile per transformer block (TorchTitan's granularity: small graphs, fast recompiles)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from lit_titan.callbacks._requires import transform_strategy


class Compile(L.Callback):
    """Compile each block in place (``nn.Module.compile``: parameter names stay unchanged).

    Applied by the strategy after TP and activation checkpointing and before FSDP. Safe with TP
    because the residual stream between blocks stays a Shard(1) DTensor (see
    lit_titan/models/llama3/parallelize.py; local tensors there train silently wrong under compile).
    """

    def __init__(self, fullgraph: bool = True, backend: str = "inductor", mode: str | None = None,
                 compile_loss: bool = False) -> None:
        self.fullgraph, self.backend, self.mode, self.compile_loss = fullgraph, backend, mode, compile_loss
        self._registered = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = transform_strategy(trainer, "Compile")
        dims = strategy.parallel_dims
        if dims is not None and dims.cp > 1:
            raise NotImplementedError("Compile with context parallelism (parallel.cp > 1) is not supported yet: the "
                                      "all-gather-KV attention runs collectives inside an autograd Function; drop "
                                      "the compile callback or set parallel.cp=1")
        if not self._registered:
            strategy.register_transform("compile", self._apply)
            if self.compile_loss and hasattr(pl_module, "compute_loss"):
                pl_module.compute_loss = torch.compile(pl_module.compute_loss, backend=self.backend)
            self._registered = True

    def _apply(self, model: nn.Module, plan, strategy) -> None:
        for block in plan.blocks(model):
            block.compile(fullgraph=self.fullgraph, backend=self.backend, mode=self.mode)
