"""Fleet-scale dry-run planner: the training parallelisation on a meta model over a fake process group."""

from lit_titan.planner.core import REQUIRED_KEYS, make_plan_from_cfg, render_table

__all__ = ["REQUIRED_KEYS", "make_plan_from_cfg", "render_table"]
