"""Hugging Face Llama interop (issue 7): export to / start from a HF ``LlamaForCausalLM`` directory."""

from __future__ import annotations

from torch import nn

from lit_titan.models.llama3.args import ModelArgs


def check_hf_dir(path: str, args: ModelArgs) -> None:
    """Refuse a HF directory that is missing or does not match ``args``, before any process starts."""
    raise NotImplementedError("model.init_from_hf is not implemented yet")


def load_hf_weights(model: nn.Module, path: str) -> None:
    """Copy a HF checkpoint into ``model``, whose parameters may be FSDP/TP DTensors or a PP stage."""
    raise NotImplementedError("model.init_from_hf is not implemented yet")
