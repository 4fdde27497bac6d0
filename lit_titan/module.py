"""PretrainModule: the LightningModule users run and subclass.

Override points (no need to copy ``training_step``):
- ``build_model()``   -> the nn.Module to train (called on the meta device);
- ``split_batch()``   -> (inputs, labels) of a token batch; a label of -100 is ignored;
- ``compute_loss()``  -> the mean over the valid targets, or one loss per target (see its docstring);
- ``count_targets()`` -> how many targets a ``compute_loss`` mean covers (default: labels other than -100);
- ``configure_optimizers()`` / ``build_optimizer()`` / ``build_scheduler()``.

The module never parallelises anything itself: under ``TitanStrategy`` the strategy applies the
model family's plan and materialises the weights; under any other strategy the module
materialises the model on its device with the same seeded ``init_weights``.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_titan.job.settings import LossConfig
from lit_titan.models import registry
from lit_titan.models.loss import at_least_fp32, resolve_chunk_tokens
from lit_titan.models.moe import MoE, take_injected_aux_loss, update_expert_bias
from lit_titan.observe.expert_load import expert_load_metrics
from lit_titan.observe.log_cadence import forget_logged, is_logging_step
from lit_titan.observe.phases import PhaseClock, phase
from lit_titan.optim.build import OptimConfig, build_optimizer, build_scheduler
from lit_titan.strategies.contract import ModuleContract, StrategyContract, contract
from lit_titan.strategies.grad_norm import clip_grads_with_norm_, total_grad_norm
from lit_titan.strategies.step import IGNORE_INDEX, count_valid


class PretrainModule(L.LightningModule, ModuleContract):
    # Set by the Timeline callback while training (ModuleContract); gradient clipping reports its time to it.
    phase_clock: PhaseClock | None = None

    def __init__(
        self,
        model: str = "llama3_debug",
        model_overrides: dict[str, Any] | None = None,
        optim: OptimConfig | dict[str, Any] | None = None,
        seed: int = 0,
        init_from_hf: str | None = None,
        loss_chunk_tokens: int | str | None = LossConfig.chunk_tokens,
        step_micro_batch: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(optim, dict) or optim is None:
            optim = _optim_config(optim or {})
        self.save_hyperparameters(
            {
                "model": model,
                "model_overrides": dict(model_overrides or {}),
                "optim": asdict(optim),
                "seed": seed,
                "init_from_hf": init_from_hf,
                "loss_chunk_tokens": loss_chunk_tokens,
                "step_micro_batch": step_micro_batch,
            }
        )
        self.model_args = registry.model_args(model, **dict(model_overrides or {}))
        self.loss_chunk_tokens = resolve_chunk_tokens(loss_chunk_tokens, self.model_args.vocab_size)
        self.optim_config = optim
        self.seed = seed
        self.init_from_hf = init_from_hf
        # Under TitanStrategy each training batch is this rank's whole optimizer step, which its step runner trains
        # in micro-batches of this many sequences (``data.micro_batch_size``; None: the data module's, else whole).
        self.step_micro_batch = step_micro_batch
        self._micro_batches_per_batch = 1
        self.model: nn.Module | None = None
        self._step_loss = torch.zeros(())
        self._step_aux_loss: Tensor | None = None
        self._micro_batches = 0
        self._tokens_per_step = 0
        self._last_grad_norm: Tensor | None = None

    # ---- override points ------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The network to train; built under the meta device, so allocate nothing real here."""
        return registry.build_model(self.model_args)

    def compute_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Next-token cross-entropy: the mean over this micro-batch's valid targets (labels other than -100).

        The contract of an override: return that mean (a scalar over the ``count_targets(labels)`` targets,
        what ``F.cross_entropy`` gives by default), or one loss per target shaped like ``labels`` (zero where
        ignored). The step runner (``strategies/step.py``) turns either into a sum and divides by the step's
        valid targets over every rank and micro-batch, so the loss is one device's under every layout.
        """
        return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), labels.flatten(0, 1))

    def count_targets(self, labels: Tensor) -> Tensor:
        """How many targets a ``compute_loss`` mean covers (a device scalar): labels other than -100. Override
        together with a ``compute_loss`` that masks by another rule."""
        return count_valid(labels)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.optim_config)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return build_scheduler(optimizer, self.optim_config)

    # ---- Lightning hooks ------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this more than once
            return
        with torch.device("meta"):
            self.model = self.build_model()
        if self.loss_in_model:
            self.model.output.chunk_tokens = self.loss_chunk_tokens
        if not self.strategy_contract.owns_parallelization:
            self.model.to_empty(device=self.trainer.strategy.root_device)
            self.model.init_weights(self.seed)
            self.load_initial_weights()

    def load_initial_weights(self) -> None:
        """Called once the (possibly sharded) model holds its seeded init: start from given weights.

        Under TitanStrategy this runs after parallelisation and materialisation, so it must load
        into FSDP/TP/PP-sharded parameters. A resumed run overwrites these weights afterwards.
        """
        if self.init_from_hf:
            adapter = registry.hf_adapter(self.model_args, f"model.init_from_hf={self.init_from_hf}")
            adapter.load_hf_weights(self.model, self.init_from_hf)
            note = adapter.import_note(self.model_args)
            if note:
                from lightning.pytorch.utilities import rank_zero_info

                rank_zero_info(f"model.init_from_hf: {note}")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.build_optimizer()
        scheduler = self.build_scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def forward(self, tokens: Tensor, positions: Tensor | None = None, documents: Tensor | None = None) -> Tensor:
        return (
            self.model(tokens, positions) if documents is None else self.model(tokens, positions, documents=documents)
        )

    def unpack_batch(self, batch: Tensor | dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """A token batch, or ``{"tokens", "positions"?, "documents"?}`` (``data.document_positions`` /
        ``data.document_masking``) -> (tokens, the model's keyword inputs present in the batch).

        ``positions`` and ``documents`` are per input token ([b, s]); pipeline parallelism splits
        them into micro-batches like the inputs and hands them to every stage.
        """
        if isinstance(batch, dict):
            return batch["tokens"], {k: batch[k] for k in ("positions", "documents") if batch.get(k) is not None}
        return batch, {}

    def split_batch(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """[b, seq_len + 1] token blocks -> (inputs, next-token labels); a label of -100 is ignored."""
        return batch[:, :-1], batch[:, 1:]

    def inputs_and_labels(self, batch: Tensor | dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(inputs, labels, the model's per-token inputs) of a batch by ``unpack_batch`` and ``split_batch``, with
        the labels the data marks unpredictable ignored (``ignore``: an EOS's label under document masking)."""
        tokens, extra = self.unpack_batch(batch)
        inputs, labels = self.split_batch(tokens)
        ignore = batch.get("ignore") if isinstance(batch, dict) else None
        if ignore is not None:
            labels = labels.masked_fill(ignore.to(device=labels.device, dtype=torch.bool), IGNORE_INDEX)
        return inputs, labels, extra

    @property
    def loss_in_model(self) -> bool:
        """True when the model's head computes the (chunked) loss from labels itself.

        That is when chunking is on (``loss.chunk_tokens``) or the model adds loss terms of its own (an
        MoE family's auxiliary loss), the model has such a head and the loss is the default one: a
        subclass overriding ``compute_loss`` gets full logits (and no auxiliary loss).
        """
        head = getattr(self.model, "output", None) if self.model is not None else None
        # a model that adds its own loss terms where the loss is made (MoE: the router's balancing loss)
        adds_terms = hasattr(self.model, "last_aux_loss")
        return (
            (self.loss_chunk_tokens > 0 or adds_terms)
            and type(self).compute_loss is PretrainModule.compute_loss
            and hasattr(head, "chunk_tokens")
        )

    def model_loss(
        self, inputs: Tensor, labels: Tensor, positions: Tensor | None = None, documents: Tensor | None = None
    ) -> Tensor:
        """The micro-batch loss: the head's chunked loss, or ``compute_loss`` over full logits.

        ``documents`` (``data.document_masking``) makes attention block-causal per document.
        """
        extra = {} if documents is None else {"documents": documents}
        if self.loss_in_model:
            return self.model(inputs, positions, labels=labels, **extra)
        return self.compute_loss(self(inputs, positions, **extra), labels)

    def training_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """One micro-batch under a strategy that is not lit-titan's (Lightning accumulates); under
        ``TitanStrategy`` the step runner trains the whole step with the same override points."""
        inputs, labels, extra = self.inputs_and_labels(batch)
        loss = self.model_loss(inputs, labels, **extra)
        self.record_train_loss(loss, inputs)
        return loss

    def validation_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        inputs, labels, extra = self.inputs_and_labels(batch)
        loss = self.model_loss(inputs, labels, **extra)
        self.record_val_loss(loss)
        return loss

    def test_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """The held-out loss, as validation computes it (the data module tests on its held-out split)."""
        inputs, labels, extra = self.inputs_and_labels(batch)
        loss = self.model_loss(inputs, labels, **extra)
        self.record_test_loss(loss)
        return loss

    def predict_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """The logits of the batch's inputs ([micro-batch, seq_len, vocab]), whole under tensor parallelism."""
        inputs, _, extra = self.inputs_and_labels(batch)
        logits = self(inputs, **extra)
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits

    def record_train_loss(self, loss: Tensor, inputs: Tensor) -> None:
        """Accumulate a micro-batch's loss; their mean (over micro-batches and ranks) is logged once per step.

        Under TitanStrategy ``loss`` is the micro-batch's share of the step's normalised loss times the
        micro-batches, so the mean is the step's loss: the plain mean when every micro-batch holds as many
        valid targets."""
        # Starts from the first micro-batch's loss, on its device: no host-made zero to copy over.
        loss = _plain(loss.detach())
        loss = loss.to(torch.promote_types(loss.dtype, torch.float32))  # 64-true logs in float64
        self._step_loss = loss if self._micro_batches == 0 else self._step_loss + loss
        aux = self._micro_batch_aux_loss()
        if aux is not None:
            first = self._micro_batches == 0 or self._step_aux_loss is None
            self._step_aux_loss = aux if first else self._step_aux_loss + aux
        self._micro_batches += 1
        self._tokens_per_step_accumulate(inputs)

    def _micro_batch_aux_loss(self) -> Tensor | None:
        """An MoE family's balancing loss of this micro-batch, detached: the one the model added to ``loss``, or
        under pipeline parallelism this rank's layers' part of it (each layer back-propagated its own share,
        outside the last stage's loss; the parts are summed over the stages where the step is logged)."""
        if not hasattr(self.model, "last_aux_loss"):
            return None
        if self.strategy_contract.pp_group is not None:  # pipeline stages: not fault tolerance's own backward
            moe = getattr(self.model_args, "moe", None)  # the same on every stage, so every stage joins the sum
            if moe is None or not moe.has_aux_loss:
                return None
            return take_injected_aux_loss(self.model, self.strategy_contract.root_device)
        aux = self.model.last_aux_loss
        return None if aux is None else _plain(aux).to(torch.promote_types(aux.dtype, torch.float32))

    def record_val_loss(self, loss: Tensor) -> None:
        self.log("val/loss", _plain(loss.detach()), sync_dist=True, prog_bar=True)

    def record_test_loss(self, loss: Tensor) -> None:
        self.log("test/loss", _plain(loss.detach()), sync_dist=True)

    def on_fit_start(self) -> None:
        # MoE layers' global-batch auxiliary loss sums its token counts over the ranks sharing the batch, the
        # sequence-wise one its per-sequence statistics over the context ranks sharing the sequences
        group, cp_group = self.strategy_contract.batch_group, self.strategy_contract.cp_group
        for m in self.model.modules() if self.model is not None else ():
            if isinstance(m, MoE):
                m.count_group, m.cp_group = group, cp_group

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The previous logging step's row is written: drop its values, or Lightning would read the
        # progress-bar loss back to the host (.item()) after every later batch. Subclasses that
        # override this hook call super().
        forget_logged(self.trainer, "train/")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log what the optimizer measured during the step just taken (Muon's update RMS), then forget it."""
        for optimizer in self.trainer.optimizers:
            measured = getattr(optimizer, "update_rms", None)
            if measured:
                for group, rms in measured.items():
                    self.log(f"optim/update_rms/{group}", rms, on_step=True, on_epoch=False)
                optimizer.update_rms = {}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log once per logging step (``trainer.log_every_n_steps``): the step's mean loss, lr, grad norm.

        The global grad norm is computed every step (clipping needs it; its reductions are the
        model's own). Everything else happens on logging steps only: the loss reduction over the
        data-parallel group (``sync_dist``) and the host-to-device copies of Python numbers that
        ``self.log`` makes. Other steps issue no collective and read nothing back to the host.
        """
        with phase(self.phase_clock, "grad_clip"):
            self._last_grad_norm = total_grad_norm(list(self.parameters()), pp_group=self.strategy_contract.pp_group)
        if is_logging_step(self.trainer, self.global_step + 1):
            step_loss = self._step_loss / max(self._micro_batches, 1)
            aux = None if self._step_aux_loss is None else self._step_aux_loss / max(self._micro_batches, 1)
            pp_group = self.strategy_contract.pp_group
            if aux is not None and pp_group is not None:
                # each stage holds its layers' part, and the pipeline's loss (the last stage's) excludes it
                torch.distributed.all_reduce(aux, group=pp_group)
                step_loss = step_loss + aux
            self.log("train/loss", step_loss, sync_dist=True, prog_bar=True, on_step=True, on_epoch=False)
            if aux is not None:
                self.log("train/aux_loss", aux, sync_dist=True, on_step=True, on_epoch=False)
            for key, value in expert_load_metrics(self.model, self.strategy_contract.batch_group).items():
                self.log(key, value, on_step=True, on_epoch=False)  # MoE: max/mean tokens per expert, per layer
            self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)
            self.log("train/grad_norm", self._last_grad_norm, on_step=True, on_epoch=False)
            self.log(
                "train/tokens_seen", float((self.global_step + 1) * self._tokens_per_step), on_step=True, on_epoch=False
            )
            # Muon: this step's update RMS per layer group, logged by on_train_batch_end (optim/muon.py)
            getattr(optimizer, "optimizer", optimizer).measure_update_rms = True
        self._micro_batches = 0  # the next record_train_loss starts a new sum
        # MoE aux-loss-free balancing: the step's forwards are all done, so its token counts are complete
        # (the bias only steers the next forwards' selection: before or after optimizer.step is the same);
        # summed over the ranks sharing the global batch, so every rank moves the bias alike.
        update_expert_bias(self.model, self.strategy_contract.batch_group)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        # Lightning zeroes gradients between training_step and backward; under TitanStrategy the step
        # runner runs every backward inside training_step and zeroes them itself first.
        if self.strategy_contract.runs_steps:
            return  # zeroed by the step runner before the step's first backward, inside training_step
        optimizer.zero_grad()

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        """Clip by the true global norm (across every mesh dim), computed once per step."""
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("PretrainModule clips by norm only; set trainer.gradient_clip_algorithm=norm")
        params = [p for p in self.parameters() if p.grad is not None]
        with phase(self.phase_clock, "grad_clip"):
            clip_grads_with_norm_(params, gradient_clip_val, self._last_grad_norm)

    # ---- what the strategy and callbacks read (strategies/contract.py, ModuleContract) -----------
    @property
    def tokens_per_step(self) -> int:
        return self._tokens_per_step

    @property
    def step_mean_loss(self) -> Tensor | None:
        return self._step_loss / self._micro_batches if self._micro_batches else None

    @property
    def last_grad_norm(self) -> Tensor | None:
        return self._last_grad_norm

    # ---- helpers --------------------------------------------------------------------------------
    @property
    def strategy_contract(self) -> StrategyContract:
        """What this module may ask of the trainer's strategy (strategies/contract.py)."""
        return contract(self.trainer.strategy)

    def _tokens_per_step_accumulate(self, inputs: Tensor) -> None:
        if self.global_step == 0 or not self._tokens_per_step:
            dp = self.strategy_contract.data_parallel_size
            accum = self.trainer.accumulate_grad_batches * self._micro_batches_per_batch
            self._tokens_per_step = inputs.numel() * dp * accum


def _plain(t: Tensor) -> Tensor:
    """A replicated DTensor (e.g. the loss under loss parallel) as a plain tensor, for logging."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optim_config(values: dict[str, Any]) -> OptimConfig:
    names = {f.name for f in fields(OptimConfig)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown optim key(s) {sorted(unknown)}; valid: {sorted(names)}")
    return OptimConfig(**values)
