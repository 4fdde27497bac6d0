"""Fleet-scale dry-run planner: the training parallelisation on a meta model over a fake process group."""

from lit_titan.planner.core import REQUIRED_KEYS, make_plan_from_cfg, render_table
from lit_titan.planner.launch import check_cluster, launch_command

__all__ = ["REQUIRED_KEYS", "check_cluster", "launch_command", "make_plan_from_cfg", "render_table"]
