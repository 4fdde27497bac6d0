"""Tensor + sequence parallel application from a model family's per-module plan.

Callbacks may rewrite the plan's styles per module before they are applied (``StyleRewrite``,
registered with ``TitanStrategy.register_tp_style_rewrite``): e.g. ``Float8(float8_tp=True)``
swaps in torchao's float8 styles for the layers it converted. The plan itself stays free of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fnmatch import fnmatch
from typing import Any

from torch import nn

from lit_titan.strategies.parallel_plan import ParallelPlan

# fn(fqn, module, style) -> style. ``fqn`` is the module's name in the model TP is applied to ("" for
# that model itself), ``module`` the module the style will be applied to, ``style`` the plan's
# ParallelStyle (or what an earlier rewrite returned). Return ``style`` to keep it.
StyleRewrite = Callable[[str, nn.Module, Any], Any]


def tp_plans(
    model: nn.Module, plan: ParallelPlan, loss_parallel: bool, rewrites: Sequence[StyleRewrite] = ()
) -> list[tuple[nn.Module, Any]]:
    """``(module, parallelize_plan)`` pairs, in the order ``apply_tensor_parallel`` applies them.

    The plan's root styles, then each block's, then the pipeline stage boundary styles, each
    passed through ``rewrites`` in registration order. Wildcard keys (``parallelize_module``'s
    fnmatch syntax) are expanded to the modules they match, so every rewrite sees one module.
    No process group is needed: this only builds the dicts.
    """
    names = {id(m): n for n, m in model.named_modules()}

    def rewrite(fqn: str, module: nn.Module, style: Any) -> Any:
        for fn in rewrites:
            style = fn(fqn, module, style)
        return style

    def rewrite_dict(root: nn.Module, styles: dict) -> dict:
        if not rewrites:
            return styles
        prefix = names.get(id(root), "")
        out = {}
        for key, style in styles.items():
            for path in _expand(root, key):
                module = root.get_submodule(path) if _resolves(root, path) else None
                out[path] = style if module is None else rewrite(_join(prefix, path), module, style)
        return out

    plans: list[tuple[nn.Module, Any]] = [(model, rewrite_dict(model, plan.tp_root(model, loss_parallel)))]
    plans += [(block, rewrite_dict(block, plan.tp_block(block))) for block in plan.blocks(model)]
    for style in plan.tp_stage_io(model) if plan.tp_stage_io else ():
        plans.append((model, rewrite("", model, style)))
    return plans


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, plan: ParallelPlan, loss_parallel: bool, rewrites: Sequence[StyleRewrite] = ()
) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for module, styles in tp_plans(model, plan, loss_parallel, rewrites):
        parallelize_module(module, tp_mesh, styles)
    # Each style replaced its module's parameters with new DTensors, which unties weights the model
    # shares (tied embeddings); a model that has such weights re-ties them (same placements).
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _resolves(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _expand(root: nn.Module, key: str) -> list[str]:
    """The submodule paths a plan key matches (itself when it has no wildcard or matches nothing)."""
    if not any(c in key for c in "*?["):
        return [key]
    atoms = key.split(".")
    matches = [
        name
        for name, _ in root.named_modules()
        if name and len(name.split(".")) == len(atoms) and all(fnmatch(a, p) for a, p in zip(name.split("."), atoms))
    ]
    return matches or [key]  # no match: parallelize_module warns and skips, as without rewrites
