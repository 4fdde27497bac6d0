"""Parallel execution: the strategy, the mesh, and one module per parallelism.

The names below the degrees load lazily (PEP 562): the config schema imports ``strategies.settings``
before torch and Lightning are loaded, and importing a submodule runs this file first.
"""

from typing import Any

from lit_titan.strategies.parallel_dims import MESH_DIMS, LayoutError, ParallelDims
from lit_titan.strategies.settings import ParallelConfig

_LAZY = {
    "ParallelPlan": "parallel_plan",
    "TRANSFORM_SLOTS": "strategy",
    "TitanStrategy": "strategy",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"lit_titan.strategies.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lit_titan.strategies' has no attribute {name!r}")


__all__ = [
    "MESH_DIMS",
    "TRANSFORM_SLOTS",
    "LayoutError",
    "ParallelConfig",
    "ParallelDims",
    "ParallelPlan",
    "TitanStrategy",
]
