"""A Lightning single-file checkpoint (``trainer.save_checkpoint("x.ckpt")`` under another strategy: one device,
DDP, ``ModelParallelStrategy(save_distributed_checkpoint=False)``) loaded into the parallelised model.

Lightning's own loader for it (``lightning.fabric.strategies.model_parallel._load_checkpoint``) loads every
parameter of the file into the model, which under pipeline parallelism holds only its stages, and rekeys the
optimizer state through FSDP1's helper; here each rank takes its own parameters by name, and the optimizer state,
saved by position, is matched to names by the position of each parameter in the same parameter groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_titan.checkpoint.layout import CheckpointError


def load_single_file(model: nn.Module, optimizers: list[torch.optim.Optimizer], path: Path) -> dict[str, Any]:
    """Weights and optimizer state of ``path`` into ``model`` (any layout); returns the rest (loops, schedulers,
    callbacks, the data position) for Lightning to restore. Loaded with ``weights_only``: nothing in it runs."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # pickle refused by weights_only, or not a torch file at all
        raise CheckpointError(
            f"{path} is not a single-file checkpoint that loads without running code "
            f"({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no state_dict)")
    full = checkpoint.pop("state_dict")
    local = get_model_state_dict(model)
    missing = sorted(set(local) - set(full))
    if missing:
        raise CheckpointError(
            f"{path} has no {missing[0]} (and {len(missing) - 1} more of this model's entries): saved for another model"
        )
    full_options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, {name: full[name] for name in local}, options=full_options)
    saved_states = checkpoint.pop("optimizer_states", None)
    if saved_states is None:  # save_weights_only: Lightning says so when it restores the schedulers
        return checkpoint
    if len(saved_states) != len(optimizers):
        raise CheckpointError(f"{path} holds {len(saved_states)} optimizer state(s), this module has {len(optimizers)}")
    for optimizer, saved in zip(optimizers, saved_states):
        names = [group["params"] for group in get_optimizer_state_dict(model, optimizer)["param_groups"]]
        set_optimizer_state_dict(model, optimizer, _by_name(saved, names, path), options=full_options)
    return checkpoint


def _by_name(saved: dict[str, Any], names: list[list[str]], path: Path) -> dict[str, Any]:
    """A torch optimizer state dict (keyed by position) keyed by this optimizer's parameter names instead."""
    groups = saved["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(n) for n in names]:
        raise CheckpointError(
            f"{path}: its optimizer's parameter groups hold {sizes} parameters, this rank's {[len(n) for n in names]} "
            f"(under pipeline parallelism a rank holds only its stages): resume it under the layout it was saved "
            f"with, or under one without pipeline parallelism, and save again (a sharded checkpoint loads anywhere)"
        )
    by_index = {
        index: name for group, group_names in zip(groups, names) for index, name in zip(group["params"], group_names)
    }
    return {
        "state": {by_index[index]: state for index, state in saved["state"].items()},
        "param_groups": [{**group, "params": group_names} for group, group_names in zip(groups, names)],
    }
