"""Llama 3.1 family: model and flavors (its parallel plan: ``parallelize.py``, reached through the registry)."""

from lit_titan.models.llama3.args import FLAVORS, ModelArgs, RopeScaling, get_flavor
from lit_titan.models.llama3.model import Transformer

__all__ = ["FLAVORS", "ModelArgs", "RopeScaling", "Transformer", "get_flavor"]
