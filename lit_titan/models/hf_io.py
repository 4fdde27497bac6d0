"""Hugging Face checkpoint directories, whatever the model family: safetensors shards, the index, dtypes.

A family's adapter (e.g. ``models/llama3/hf.py``) knows its tensor names, any per-tensor layout
change and its ``config.json``; everything about files lives here, so a second family reuses it.
Only safetensors are read or written (never pickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# (a safetensors slice, global offsets, sizes) -> that block of the tensor, in our layout
BlockReader = Callable[[Any, tuple[int, ...], tuple[int, ...]], Tensor]


# ---- reading -------------------------------------------------------------------------------------
def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def weight_files(path: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (via the index, or each file's header)."""
    from safetensors import safe_open

    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(path.glob("*.safetensors"))
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            found.update({k: file for k in f.keys()})
    return found


def check_weight_files(root: Path, where: str, hint: str) -> dict[str, Path]:
    """``weight_files(root)``, refusing a directory without readable safetensors (pickle is never read)
    or whose index names missing files: FileNotFoundError naming ``where`` and ending with ``hint``."""
    try:
        files = weight_files(root)
    except Exception as err:  # noqa: BLE001 - a corrupt index or header, reported as such
        raise FileNotFoundError(f"{where}: cannot read its safetensors weights ({err}); {hint}") from err
    if not files:
        pickled = [p.name for p in root.glob("*.bin")] + [p.name for p in root.glob("*.pt*")]
        extra = f" (found {pickled[:3]}: only safetensors are read, never pickle)" if pickled else ""
        raise FileNotFoundError(f"{where} holds no *.safetensors weights{extra}; {hint}")
    missing_files = sorted({f.name for f in files.values() if not f.is_file()})
    if missing_files:
        raise FileNotFoundError(f"{where}: weight files {missing_files} listed in {INDEX_FILE} are missing")
    return files


def tensor_shapes(files: dict[str, Path], names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of ``names`` read from the safetensors headers only (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt") as f:
            shapes[name] = tuple(int(n) for n in f.get_slice(name).get_shape())
    return shapes


def local_region(param: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of the block of ``param`` this rank holds: all of it unless a DTensor.

    For a DTensor this is the chunk DCP saves for it (``__create_chunk_list__``), FSDP x TP strided
    sharding included.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape)
    chunks = param.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"a parameter with {len(chunks)} local chunks cannot be loaded from Hugging Face weights")
    return tuple(chunks[0].offsets), tuple(chunks[0].sizes)


def read_block(tensor_slice: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Tensor:
    """Rows/columns ``offsets:offsets+sizes`` of one stored tensor, reading only that block."""
    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    return tensor_slice[index] if index else tensor_slice[:]


def copy_local_into(param: Tensor, tensor_slice: Any, name: str, read: BlockReader = read_block) -> None:
    """Write this rank's block of one stored tensor into a parameter, plain or DTensor."""
    from torch.distributed.tensor import DTensor

    shape = tuple(int(n) for n in tensor_slice.get_shape())
    if shape != tuple(param.shape):
        raise ValueError(f"{name}: Hugging Face tensor has shape {list(shape)}, the model {list(param.shape)}")
    local = param.to_local() if isinstance(param, DTensor) else param
    offsets, sizes = local_region(param)
    if tuple(local.shape) != sizes:
        raise ValueError(f"{name}: local shard {list(local.shape)} is not the block {list(sizes)} its placements give")
    if local.numel():
        local.copy_(read(tensor_slice, offsets, sizes))


@torch.no_grad()
def load_into(
    model: nn.Module,
    path: str | Path,
    source: Callable[[str, dict[str, Path]], str],
    reader: Callable[[str], BlockReader] = lambda name: read_block,
) -> None:
    """Copy a HF directory into ``model``, whose parameters may be FSDP/TP DTensors or a PP stage.

    ``source(our_name, files)`` names the stored tensor of each parameter, ``reader(our_name)`` how to
    read a block of it in our layout. Each rank reads only the slice its shard covers (safetensors
    ``get_slice``, the offsets DCP uses), so at world size N a rank of a fully sharded model reads
    about 1/N of the checkpoint. No collective runs, so any placement works.
    """
    from safetensors import safe_open

    files = weight_files(Path(path).expanduser())
    plan = [(name, param, source(name, files)) for name, param in model.named_parameters()]
    missing = [src for _, _, src in plan if src not in files]
    if missing:
        raise KeyError(f"{path} lacks tensors {missing[:4]}")
    for file in sorted({files[src] for _, _, src in plan}):
        with safe_open(str(file), framework="pt") as f:
            for name, param, src in plan:
                if files[src] == file:
                    copy_local_into(param, f.get_slice(src), name, reader(name))


# ---- writing -------------------------------------------------------------------------------------
def shard_names(n_shards: int) -> list[str]:
    """HF's file names: one ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``."""
    if n_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_shard_bytes`` (a bigger tensor stands alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    """One safetensors file, with the usual umask-based mode (safetensors creates files 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_index(out: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_config(out: Path, config: dict[str, Any]) -> None:
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
