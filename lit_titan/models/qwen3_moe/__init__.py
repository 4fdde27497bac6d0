"""Qwen3-MoE family: args and flavors, model, Hugging Face adapter, active-parameter FLOP count.

``SPEC`` describes the family for the model registry (name -> spec); nothing outside ``models/``
names the family.
"""

from types import MappingProxyType

from lit_titan.models.qwen3_moe import hf
from lit_titan.models.qwen3_moe import parallelize as _parallelize  # noqa: E402,F401,I001  (registers the ParallelPlan)
from lit_titan.models.qwen3_moe.args import FLAVORS, Qwen3MoEArgs, count_params, flops_per_token, get_flavor
from lit_titan.models.qwen3_moe.model import Qwen3MoE

SPEC = MappingProxyType(
    {
        "family": "qwen3_moe",
        "args": Qwen3MoEArgs,
        "model": Qwen3MoE,
        "flavors": FLAVORS,
        "get_flavor": get_flavor,
        "hf": hf,  # to_hf_state_dict / from_hf_state_dict / hf_config / save_hf
        "count_params": count_params,  # (args, active=False)
        "flops_per_token": flops_per_token,  # (args, seq_len): active parameters
    }
)

__all__ = ["FLAVORS", "SPEC", "Qwen3MoE", "Qwen3MoEArgs", "count_params", "flops_per_token", "get_flavor", "hf"]
