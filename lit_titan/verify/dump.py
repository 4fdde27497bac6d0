"""What a run computed, dumped at chosen optimizer steps, for a comparison with one process.

Why gradients and not losses: under AdamW a uniform gradient-scale error (a loss scale that forgets
accumulation, FSDP summing instead of averaging) trains to the same losses, because Adam's
m / sqrt(v) cancels the scale; and near the initial weights attention barely moves the loss. The
full gradient of every parameter before clipping, the global norm clipping used, and the weights
after the step show both.

``ParityDump`` is a Lightning callback meant for checks (``lit-titan verify``, the parity tests): at each
chosen step it gathers every parameter's full gradient *before* clipping (``on_before_optimizer_step``:
callbacks run before the module's hook computes the norm, and clipping comes after both), then after the
step the module's global norm and the full weights (with the persistent buffers, such as an MoE layer's
expert bias), and rank 0 writes ``step-NNNNNN.pt`` keyed by the single-device parameter names. Sharded
(DTensor) tensors are gathered over their own mesh (``full_tensor``); pipeline stages hold disjoint
parameters, so every rank's tensors go to rank 0 over the world group. Gathering whole tensors is why it
is for checks on shrunk models, not for a job.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lit_titan.strategies.contract import module_contract

__all__ = ["ParityDump", "gradient_reductions", "single_device_name"]

# Wrappers that activation checkpointing / compile / FSDP insert into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
REDUCTIONS_FILE = "reductions.json"
DUMP_DIR = "dump"  # a check side's dumps, under its run directory
CHECKS_FILE = "checks.json"  # and its known norm and replica findings


def single_device_name(name: str) -> str:
    """A parameter's name as one process without wrappers calls it."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: a DTensor gathered over its mesh, a wrapper subclass unwrapped."""
    if isinstance(t, DTensor):
        # Experts under EP x FSDP are (_StridedShard, Shard) on dim 0: torch warns that gathering them
        # takes two all-gathers, which only a check does.
        log = logging.getLogger("torch.distributed.tensor._redistribute")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            t = t.full_tensor()
        finally:
            log.setLevel(level)
    while is_traceable_wrapper_subclass(t):  # Float8's weights wrap the plain weight: dumps load weights_only
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t.detach().to("cpu", copy=True)


def gather_to_rank0(local: dict) -> dict | None:
    """Every rank's entries merged on rank 0 (replicas send equal copies; the first one is kept)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if parts is None:
        return None
    merged: dict = {}
    for part in parts:
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def persistent_buffers(model: torch.nn.Module):
    """Buffers a checkpoint holds (an MoE layer's expert bias): compared with the weights after each step."""
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buf


def gradient_reductions(model: torch.nn.Module) -> dict[str, str]:
    """Per parameter: over which mesh dims its gradient is reduced, how, and in which dtype.

    Read from what the gradient and its FSDP unit carry, not from the collectives themselves (FSDP reduces
    a unit's gradients in one flat buffer, which names no parameter): each mesh dim the parameter is laid
    out on, with the reduction that dim implies: an FSDP dim reduce-scatters (HSDP's replicate dim then
    all-reduces) in the unit's reduce dtype, dividing by its factor (the mean over the unit's ranks when
    none is set); a tensor-parallel ``Shard`` needs none; a ``Partial`` gradient is summed over its dim
    when the norm or the optimizer reads it.
    """
    units = _fsdp_units(model)
    out = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        unit = units.get(id(param))
        fsdp_dims = set(unit["dims"]) if unit else set()
        parts = []
        grad = param.grad if param.grad is not None else param
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            grad_places = grad.placements if isinstance(grad, DTensor) else param.placements
            for dim, (dim_name, place) in enumerate(zip(names, grad_places)):
                size = mesh.size(dim)
                sharded = place.is_shard() or type(place).__name__ == "_StridedShard"  # FSDP over TP's dim
                if size == 1:
                    if dim_name in fsdp_dims and "hook" in unit["op"]:
                        parts.append(f"{dim_name}(1): none, then FSDP's all-reduce hook divides")
                    continue
                if dim_name in fsdp_dims:
                    how = "reduce-scatter" if sharded else "all-reduce"
                    parts.append(f"{dim_name}({size}): {how} {unit['op']} in {unit['dtype']}")
                elif place.is_partial():
                    parts.append(f"{dim_name}({size}): Partial, summed when read")
                elif sharded:
                    parts.append(f"{dim_name}({size}): {place}, none")
                else:
                    parts.append(f"{dim_name}({size}): Replicate, all-reduced by its module")
        dtype = str(grad.dtype).removeprefix("torch.")
        out[single_device_name(name)] = f"{'; '.join(parts) or 'not reduced'} | grad {dtype}"
    return out


def _fsdp_units(model: torch.nn.Module) -> dict[int, dict]:
    """id(parameter) -> the FSDP unit's mesh dim names, reduce op and dtype (what its public state shows)."""
    units: dict[int, dict] = {}
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        group = getattr(state_of(), "_fsdp_param_group", None)
        if group is None:
            continue
        info = group.mesh_info
        names = info.mesh.mesh_dim_names or ()
        dims = [names[d] for d in (info.shard_mesh_dim, getattr(info, "replicate_mesh_dim", None)) if d is not None]
        factor = getattr(group, "gradient_divide_factor", None)
        op = f"sum / {factor:g}" if factor else "mean"
        if getattr(group, "_all_reduce_hook", None) is not None:
            op += ", then a hook"  # strategies/fsdp.py: the experts' divide by the rest of dp x cp
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            reduce = fsdp_param.reduce_dtype or fsdp_param.orig_dtype
            units[id(param)] = {"dims": dims, "op": op, "dtype": str(reduce).removeprefix("torch.")}
    return units


class ParityDump(L.Callback):
    """Dump full pre-clip gradients, the global grad norm and post-step weights at ``steps`` into ``out_dir``;
    ``reductions``: also each gradient's reductions (``gradient_reductions``) at the first of them."""

    def __init__(self, out_dir: str | Path, steps: list[int], reductions: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.steps = set(int(s) for s in steps)
        self.reductions = reductions
        self._pending: tuple[int, dict[str, torch.Tensor] | None] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        if step not in self.steps:
            return
        model = pl_module.model
        grads = {single_device_name(n): full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        self._pending = (step, gather_to_rank0(grads))
        if self.reductions and step == min(self.steps):
            seen = gather_to_rank0(gradient_reductions(model))
            if trainer.global_rank == 0:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                (self.out_dir / REDUCTIONS_FILE).write_text(json.dumps(seen, indent=1, sort_keys=True) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._pending is None or trainer.global_step != self._pending[0] + 1:
            return  # inside an accumulation window
        step, grads = self._pending
        self._pending = None
        model = pl_module.model
        weights = {single_device_name(n): full_tensor(p) for n, p in model.named_parameters()}
        weights.update({single_device_name(n): full_tensor(b) for n, b in persistent_buffers(model)})
        params = gather_to_rank0(weights)
        norm = module_contract(pl_module).last_grad_norm
        norm = float(full_tensor(norm)) if norm is not None else math.nan
        if trainer.global_rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"step": step, "grads": grads, "norm": norm, "params": params}, self.out_dir / f"step-{step:06d}.pt"
            )
