"""Llama 3.1 family: model, flavors, and its parallelisation plan."""

from lit_titan.models.llama3.args import FLAVORS, ModelArgs, RopeScaling, get_flavor
from lit_titan.models.llama3.model import Transformer

__all__ = ["FLAVORS", "ModelArgs", "RopeScaling", "Transformer", "get_flavor"]
from lit_titan.models.llama3 import parallelize as _parallelize  # noqa: F401  (registers the family's ParallelPlan)
