"""Float8 training (torchao): swap eligible ``nn.Linear`` layers for ``Float8Linear``.

The callback only *asks* (``lit_titan.strategies.transforms.request_float8``): it registers a
``convert`` transform with ``TitanStrategy``, which runs it
on the meta-device model before pipeline split, TP, activation checkpointing, compile and FSDP
(docs/architecture.md). Converting first means every later stage wraps the Float8 modules, and
FSDP sees torchao's float8 weight subclass, which is what makes FP8 all-gather possible.

What runs where (torch 2.14, torchao 0.18):
- CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell): real FP8 GEMMs (``_scaled_mm``).
- Anything else (CPU, older GPUs) only with ``emulate=True``: torchao's ``Float8LinearConfig.emulate``
  casts to float8 and back and does the GEMM in high precision, so the *numerics* of FP8 training
  are reproduced without FP8 units. (torch's CPU ``_scaled_mm`` also runs the non-emulated path on
  CPU, but it is no faster and has no GPU counterpart below SM89, so we do not rely on it: one
  documented path, ``emulate=True``, behaves the same on every device.)
- Tensor parallel: by default the Float8Linear modules run under the model plan's ordinary TP
  styles (the GEMM inputs are cast to float8 locally, after the bf16/fp32 collectives). With
  ``float8_tp=True`` (tensorwise only) the callback also registers a TP style rewrite
  (``TitanStrategy.register_tp_style_rewrite``) that, as TorchTitan does, swaps in torchao's
  ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` for the converted Linears and
  ``PrepareFloat8ModuleInput`` for the modules whose input is all-gathered for them, so those
  all-gathers move float8 (half the bf16 bytes). The plan's layouts are kept (the residual stream
  stays a Shard(1) DTensor). Those styles need float8 collectives: NCCL has them, gloo does not
  (``Invalid scalar type``), so they run on GPUs only (docs/parallelism.md says what is tested).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_titan.callbacks._requires import transform_strategy
from lit_titan.callbacks.settings import Float8Config
from lit_titan.settings import settings_of
from lit_titan.strategies.settings import FLOAT8_RECIPES
from lit_titan.strategies.transforms import request_float8

RECIPES = FLOAT8_RECIPES  # declared torch-free in strategies/settings.py, which the config schema imports


class Float8(L.Callback):
    """Train the model's eligible Linear layers in float8 (torchao), under ``TitanStrategy``.

    Takes a ``Float8Config`` (``callbacks/settings.py``) or its fields by name (``Float8(emulate=True)``):
        recipe: torchao recipe. ``"tensorwise"`` (one scale per tensor; fastest, and the only one with
            FP8 FSDP all-gather), ``"rowwise"`` (per-row scales, power-of-2 rounded; more accurate),
            ``"rowwise_with_gw_hp"`` (rowwise, weight gradient kept in high precision; most accurate).
        enable_fsdp_float8_all_gather: tensorwise only: FSDP all-gathers the weights already cast to
            float8 (half the bf16 traffic). Ignored (with a notice) for rowwise recipes, whose
            per-row scales torchao cannot compute before the gather.
        precompute_scales: tensorwise + FP8 all-gather only: after each optimizer step compute
            every weight's scale with one all-reduce (``precompute_float8_dynamic_scale_for_fsdp``)
            instead of one small all-reduce per weight inside the next all-gather.
        emulate: run the FP8 numerics without FP8 hardware (required on CPU / GPUs below SM89).
        filter_fqns: modules whose fully-qualified name contains any of these are kept in high
            precision. Default ``["output"]``: the LM head's logits feed the loss directly and
            FP8 there costs accuracy (TorchTitan's default too).
        min_dim: a Linear is converted only if both its in and out features are multiples of this
            (the FP8 GEMM kernels need multiples of 16).
        auto_filter_small_kn: also apply torchao's ``_auto_filter_for_recipe``, which skips GEMMs
            too small to gain from FP8 on H100 (e.g. tensorwise: K <= 4096 and N <= 1024). On by
            default for real runs; turn it off for small/debug models (and numerics studies),
            where it would otherwise leave nothing in float8. Not applied to
            ``rowwise_with_gw_hp`` (torchao 0.18 has no thresholds for it: NotImplementedError).
        float8_tp: tensorwise only (ValueError otherwise): run the TP all-gathers of the converted
            Linears' inputs (and of their output gradients) in float8 with torchao's float8 TP styles,
            chosen per module by ``tp_style``; non-converted modules (the output head, filtered or
            odd-sized Linears) keep the plan's styles. Needs a backend with float8 collectives (NCCL;
            gloo fails with "Invalid scalar type"). No effect without tensor parallelism.
    """

    def __init__(self, settings: Float8Config | None = None, **keys: Any) -> None:
        s = self.settings = settings_of(Float8Config, settings, keys)
        recipe = s.recipe
        if recipe not in RECIPES:
            raise ValueError(f"unknown Float8 recipe {recipe!r}; choose one of {list(RECIPES)}")
        if s.float8_tp and recipe != "tensorwise":
            raise ValueError(
                f"Float8(float8_tp=True) needs recipe='tensorwise' (torchao's float8 TP styles cast with one "
                f"scale per tensor), got recipe={recipe!r}; with float8_tp=False the {recipe} Float8Linear layers "
                f"run under the plan's ordinary TP styles (high-precision collectives)."
            )
        if s.min_dim < 1:
            raise ValueError(f"min_dim must be >= 1, got {s.min_dim}")
        self.recipe = recipe
        self.enable_fsdp_float8_all_gather = s.enable_fsdp_float8_all_gather and recipe == "tensorwise"
        if s.enable_fsdp_float8_all_gather and recipe != "tensorwise":
            rank_zero_info(
                f"Float8: FP8 all-gather needs the tensorwise recipe; recipe={recipe!r} gathers in the FSDP param dtype"
            )
        # Scales only matter when FSDP gathers float8 weights; otherwise there is nothing to precompute.
        self.precompute_scales = s.precompute_scales and self.enable_fsdp_float8_all_gather
        self.emulate = s.emulate
        self.filter_fqns = list(s.filter_fqns)
        self.min_dim = s.min_dim
        self.auto_filter_small_kn = s.auto_filter_small_kn
        self.float8_tp = s.float8_tp
        self.converted: list[str] = []  # fully-qualified names of the Float8Linear layers
        self._last_step: int | None = None
        self._registered_on: Any = None

    # ---- configuration --------------------------------------------------------------------------
    def float8_config(self):
        """The torchao ``Float8LinearConfig`` for this recipe and these flags."""
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(
            config, emulate=self.emulate, enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather
        )

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """True where a module becomes Float8Linear: a Linear not in ``filter_fqns`` with FP8-sized dims."""
        from torchao.float8.float8_linear import Float8Linear

        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):  # never convert twice
            return False
        if any(name in fqn for name in self.filter_fqns):
            return False
        if fqn.endswith("router.gate"):  # an MoE router scores in fp32 by design (models/moe.py); experts are no Linear
            return False
        if module.in_features % self.min_dim or module.out_features % self.min_dim:
            return False
        if self.auto_filter_small_kn and self.recipe != "rowwise_with_gw_hp":
            from torchao.float8 import _auto_filter_for_recipe  # present in torchao 0.18

            return _auto_filter_for_recipe(self.recipe, self.filter_fqns)(module, fqn)
        return True

    def convert(self, model: nn.Module, plan: Any = None, strategy: Any = None) -> None:
        """The ``convert`` transform: swap eligible Linears in place (model may be on meta)."""
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        convert_to_float8_training(model, config=self.float8_config(), module_filter_fn=self.module_filter_fn)
        self.converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
        if not self.converted:
            rank_zero_warn(
                "Float8: no Linear layer passed the filter, the model trains without float8"
                + (" (small model? try auto_filter_small_kn=False)" if self.auto_filter_small_kn else "")
            )
        else:
            rank_zero_info(
                f"Float8 ({self.recipe}{', emulated' if self.emulate else ''}): converted "
                f"{len(self.converted)} Linear layers"
            )

    def tp_style(self, fqn: str, module: nn.Module, style: Any) -> Any:
        """The TP style rewrite of ``float8_tp=True``: the plan's style, or its float8 counterpart.

        - a ``Float8Linear`` under ``ColwiseParallel`` / ``RowwiseParallel`` ->
          ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` with the same input/output layouts
          and ``use_local_output``;
        - a ``PrepareModuleInput`` that all-gathers an input (a Shard layout made Replicate) for a module
          whose direct Linear children are all ``Float8Linear`` (Llama: ``attention``, ``feed_forward``)
          -> ``PrepareFloat8ModuleInput`` with the same layouts: the input is cast to float8 once,
          before the all-gather, and every projection reuses it. The module must hand that input
          only to those Linears (true of Llama's attention and feed-forward);
        - anything else (embedding, norms, the output head when filtered, non-converted Linears,
          subclassed styles, the pipeline stage boundaries) is returned unchanged.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        if isinstance(module, Float8Linear) and type(style) in (ColwiseParallel, RowwiseParallel):
            cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            return cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        if type(style) is PrepareModuleInput and _gathers_for_float8_linears(module, style, Float8Linear):
            return PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                use_local_output=style.use_local_output,
            )
        return style

    # ---- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = transform_strategy(trainer, "Float8")
        self._check_hardware(strategy.root_device)
        if self._registered_on is not strategy:  # setup runs again on fit -> validate: register once
            request_float8(strategy, self.convert, self.tp_style if self.float8_tp else None)
            self._registered_on = strategy

    def _check_hardware(self, device: torch.device) -> None:
        if self.emulate:
            return
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            return
        where = (
            f"CUDA compute capability {torch.cuda.get_device_capability(device)}"
            if device.type == "cuda"
            else f"device type {device.type!r}"
        )
        raise RuntimeError(
            f"Float8 needs FP8 units (CUDA compute capability >= 8.9); this run has {where}. "
            f"Pass Float8(emulate=True) to run the float8 numerics without them (no speed-up)."
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step  # resumed runs start counting from their step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Precompute FP8 weight scales after every optimizer step.

        ``on_train_batch_end`` runs after ``optimizer.step()``; ``global_step`` changing tells us a
        step happened (so gradient accumulation and skipped steps are handled without private
        loop state). ``on_before_zero_grad`` would be too late: Lightning zeroes gradients inside
        the next step's closure, after that step's forward has already all-gathered the weights.
        """
        if not self.precompute_scales or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(pl_module.model)


def _gathers_for_float8_linears(module: nn.Module, style: Any, float8_linear: type) -> bool:
    """Does ``style`` (a PrepareModuleInput) all-gather an input of a module whose direct Linears are all float8?"""
    from torch.distributed.tensor import Replicate, Shard

    def gathers(src: Any, dst: Any) -> bool:
        return isinstance(src, Shard) and isinstance(dst, Replicate)

    pairs = list(zip(style.input_layouts or (), style.desired_input_layouts or ()))
    pairs += [
        (style.input_kwarg_layouts[k], style.desired_input_kwarg_layouts.get(k))
        for k in (style.input_kwarg_layouts if style.with_kwargs else {})
    ]
    linears = [m for m in module.children() if isinstance(m, nn.Linear)]
    return (
        any(gathers(src, dst) for src, dst in pairs)
        and bool(linears)
        and all(isinstance(m, float8_linear) for m in linears)
    )


__all__ = ["Float8", "RECIPES"]
