"""What a checkpoint was trained for, recorded at save and compared before a resume loads it.

A checkpoint of another model size, vocabulary or sequence length cannot continue this run: DCP
would fail deep inside loading with a shape mismatch (an 82-line traceback). The keys that fix
parameter shapes (and ``data.seq_len``) travel in ``meta.pt`` under :data:`KEY` and are compared
in the launching process, before any rank starts. The parallel layout is deliberately not
recorded: DCP reshards, so another layout loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_titan.checkpoint.layout import META_FILE, CheckpointError

KEY = "lit_titan_run"
_MODEL_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "multiple_of",
    "ffn_dim_multiplier",
    "tie_embeddings",
    # other families' shape keys (a family lacks the keys it does not have)
    "head_dim",
    "ffn_dim",
    "decoder_sparse_step",
    "mlp_only_layers",
    "moe.num_experts",
    "moe.hidden_dim",
    "moe.num_shared_experts",
)


def _get(args: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not hasattr(args, part):
            return _ABSENT
        args = getattr(args, part)
    return list(args) if isinstance(args, tuple) else args  # plain values: meta.pt loads weights_only


_ABSENT = object()


def fingerprint(args: Any, seq_len: int) -> dict[str, Any]:
    """Config key -> value, for the keys a resumed run must share (``args``: the resolved ModelArgs)."""
    values = {k: _get(args, k) for k in _MODEL_KEYS}
    out: dict[str, Any] = {f"model.{k}": v for k, v in values.items() if v is not _ABSENT}
    out["model.n_kv_heads"] = args.kv_heads  # None means n_heads: compare what the model is built with
    out["data.seq_len"] = int(seq_len)
    return out


def check_compatible(ckpt: Path, expected: dict[str, Any]) -> None:
    """Raise a one-line :class:`CheckpointError` naming the first key whose value differs.

    Checkpoints written before this record existed carry none: they are not checked here.
    """
    meta = torch.load(ckpt / META_FILE, weights_only=True, map_location="cpu")
    saved = meta.get(KEY) if isinstance(meta, dict) else None
    if not isinstance(saved, dict):
        return
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"{key}={value}: the checkpoint {ckpt.name} ({ckpt}) was saved with "
                f"{key}={saved[key]}; resume with {key}={saved[key]}, or train this model "
                f"from scratch in a new run_dir without resume"
            )
