"""Parallel execution: the strategy, the mesh, and one module per parallelism."""

from lit_titan.strategies.parallel_dims import MESH_DIMS, LayoutError, ParallelDims
from lit_titan.strategies.plan import ParallelPlan, plan_for, register_plan
from lit_titan.strategies.strategy import TRANSFORM_SLOTS, TitanStrategy

__all__ = ["MESH_DIMS", "TRANSFORM_SLOTS", "LayoutError", "ParallelDims", "ParallelPlan", "TitanStrategy",
           "plan_for", "register_plan"]
