"""The c10d flight recorder: a ring buffer of each rank's last collectives, dumped when a job hangs.

PyTorch records every collective (NCCL, and gloo since 2.7) into a per-process ring buffer when
``TORCH_FR_BUFFER_SIZE`` (alias ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is set; NCCL dumps it by itself
on a collective timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``, into ``TORCH_FR_DUMP_TEMP_FILE<rank>``).
:func:`enable` sets those before the process group exists; :func:`dump` is what the watchdog calls
when a step exceeds its timeout, so a hang leaves, per rank, which collective each rank was in.
The dump readers are PyTorch's private ``torch._C._distributed_c10d._dump_*`` functions (the
public ``torch.distributed.flight_recorder`` tool reads their output); they are looked up by name
and skipped when a torch version lacks them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["dump", "enable", "last_collectives"]


def enable(entries: int, hang_dir: Path) -> None:
    """Turn the recorder on for processes started from here (the environment is inherited).

    Values the user exported win (``setdefault``). ``entries=0`` leaves it as torch defaults it.
    """
    if entries <= 0:
        return
    # TORCH_FR_BUFFER_SIZE only: torch >= 2.11 reads it, and warns on every rank when it meets the
    # deprecated alias TORCH_NCCL_TRACE_BUFFER_SIZE (which a user may still export: it still works).
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(int(entries)))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(hang_dir / "nccl-trace-rank"))


def dump(hang_dir: Path, rank: int) -> tuple[Path | None, list[dict[str, Any]]]:
    """Write this rank's flight-recorder buffer into ``hang_dir``; returns the file and its last entries.

    NCCL: ``nccl-trace-rank<R>.pickle`` (the format torch's ``fr_trace`` analyser reads); gloo:
    ``fr-trace-rank<R>.json``. Never raises: a hung job must still exit.
    """
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        if not (dist.is_available() and dist.is_initialized()):
            return None, []
        backend = str(dist.get_backend())
        if "nccl" in backend and hasattr(c10d, "_dump_nccl_trace"):
            path = hang_dir / f"nccl-trace-rank{rank}.pickle"
            path.write_bytes(c10d._dump_nccl_trace())
            entries = []
            if hasattr(c10d, "_dump_nccl_trace_json"):
                entries = json.loads(c10d._dump_nccl_trace_json()).get("entries", [])
            return path, last_collectives(entries)
        if hasattr(c10d, "_dump_fr_trace_json"):
            text = _gloo_trace_json(c10d)
            text = text.decode() if isinstance(text, bytes) else text
            path = hang_dir / f"fr-trace-rank{rank}.json"
            path.write_text(text)
            return path, last_collectives(json.loads(text).get("entries", []))
    except Exception:  # noqa: BLE001 - diagnostics only
        pass
    return None, []


def _gloo_trace_json(c10d: Any) -> str | bytes:
    """The gloo buffer as JSON: some torch versions take the backend by name, others (2.14) no argument."""
    try:
        return c10d._dump_fr_trace_json(backend="gloo")
    except TypeError:
        return c10d._dump_fr_trace_json()


def last_collectives(entries: list[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The newest ``n`` entries, reduced to what a person compares across ranks."""
    keep = ("collective_seq_id", "profiling_name", "state", "retired", "process_group", "input_sizes")
    return [{k: e.get(k) for k in keep} for e in entries[-n:]]
