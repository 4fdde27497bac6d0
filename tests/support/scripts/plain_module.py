"""A plain LightningModule under TitanStrategy, written as for Lightning's own ``ModelParallelStrategy``.

Its ``configure_model`` applies tensor parallelism over ``device_mesh["tensor_parallel"]`` and FSDP2 over
``device_mesh["data_parallel"]`` (Lightning's dim names), its ``training_step`` logs the loss with
``sync_dist=True`` and Lightning clips the gradients. ``main(out, tp, sampler_mutant=False)`` trains 3 steps in
float64, records every parameter's full gradient before clipping and the weights after each step, then validates,
predicts and saves a checkpoint on the same Trainer (tests/unit/strategies/test_plain_module.py compares it with
one process). ``sampler_mutant``: every rank is told it is the only data-parallel replica, so each trains the same
rows, the bug a strategy's sampler arguments could have. ``manual``: the same step by Lightning's manual
optimisation with torch's loss parallel under tp (the recorded gradients are then clipped ones: compare the
weights; the logged loss is a DTensor). ``planned``: the strategy parallelises the network by a ``ParallelPlan``.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_titan import TitanStrategy
from lit_titan.strategies.parallel_plan import ParallelPlan

VOCAB, DIM, HIDDEN, SEQ, ROWS = 64, 32, 64, 16, 24
CLIP = 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class PlainGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net().double()  # float64 under precision="32-true" (Lightning has no 64-true here)
        self.parallelised = False
        self.loss_parallel = False

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.parallelised or self.device_mesh is None:  # called again after fit; or not under a mesh
            return
        self.parallelised = True
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            for block in self.model.blocks:
                parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            if self.loss_parallel:  # logits sharded over the vocabulary, the loss a DTensor (torch's loss parallel)
                parallelize_module(
                    self.model, tp, {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
                )
        if dp.size() > 1:
            for block in self.model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        with self._loss_context():
            self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        with self._loss_context():
            self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        logits = self.model(batch[0])
        return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).argmax(-1)

    def _loss(self, batch) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten())

    def _loss_context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        tp = self.device_mesh["tensor_parallel"].size()
        return loss_parallel() if self.loss_parallel and tp > 1 else nullcontext()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _block_styles(block: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def plan() -> ParallelPlan:
    """The same layout as ``PlainGPT.configure_model``, said as a plan: the strategy applies it."""
    return ParallelPlan(
        tp_root=lambda model, loss_parallel: {},
        tp_block=_block_styles,
        blocks=lambda model: model.blocks,
        fsdp_units=lambda model: list(model.blocks),
        block_container="blocks",
    )


class PlannedGPT(PlainGPT):
    """The same network, parallelised by ``TitanStrategy(plan=plan())`` instead of its own ``configure_model``."""

    def configure_model(self) -> None:
        pass


class ManualGPT(PlainGPT):
    """The same step optimised by hand (Lightning's manual optimisation): zero, backward, clip, step; under tensor
    parallelism with torch's loss parallel (its backward inside the context: here, in the step), so the loss it
    logs with ``sync_dist=True`` is a DTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.loss_parallel = True

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        with self._loss_context():
            loss = self._loss(batch)
            self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        self.log("train_loss", loss, sync_dist=True)


class Record(L.Callback):
    """Full gradients before clipping, and the weights after each step (rank 0 keeps them)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: _full(p.grad) for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params.append({n: _full(p) for n, p in pl_module.named_parameters()})


class SamplerMutant(TitanStrategy):
    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": 1, "rank": 0}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _data(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (ROWS, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False)


def main(out: str, tp: int, sampler_mutant: bool = False, manual: bool = False, planned: bool = False) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // tp
    strategy = (SamplerMutant if sampler_mutant else TitanStrategy)(
        tensor_parallel_size=tp, plan=plan() if planned else None
    )
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=3,
        gradient_clip_val=None if manual else CLIP,
        limit_val_batches=2,
        limit_test_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    module = ManualGPT() if manual else PlannedGPT() if planned else PlainGPT()
    global_batch = 4
    loader = _data(global_batch // dp)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    in_fit = float(trainer.callback_metrics["train_loss"])
    val = float(trainer.validate(module, dataloaders=loader, verbose=False)[0]["val_loss"])
    tested = float(trainer.test(module, dataloaders=loader, verbose=False)[0]["test_loss"])
    predicted = torch.cat(trainer.predict(module, dataloaders=_data(global_batch // dp)))
    ckpt = Path(out).with_suffix(".ckpt")
    trainer.save_checkpoint(ckpt, weights_only=False)
    if trainer.global_rank == 0:
        torch.save(
            {
                "grads": record.grads,
                "params": record.params,
                "train_loss": in_fit,
                "val_loss": val,
                "test_loss": tested,
                "predicted": predicted,
                "mesh": strategy.device_mesh.mesh_dim_names,
                "saved": ckpt.is_dir(),
            },
            out,
        )
