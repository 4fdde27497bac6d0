"""Sharded checkpoints: asynchronous, atomically published, validated before loading."""

from lit_titan.checkpoint.layout import (
    CheckpointError,
    latest_valid,
    partial_path,
    prune,
    published,
    set_aside,
    step_dir_name,
    validate,
)
from lit_titan.checkpoint.writer import CheckpointWriter, load_sharded

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "latest_valid",
    "load_sharded",
    "partial_path",
    "prune",
    "published",
    "set_aside",
    "step_dir_name",
    "validate",
]
