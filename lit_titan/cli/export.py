"""``lit-titan export CHECKPOINT_DIR OUT_DIR``: a training checkpoint as a Hugging Face model directory.

Writes ``config.json`` and the weights as safetensors (``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` past ``--max-shard-size``)
that transformers loads (Llama: ``LlamaForCausalLM.from_pretrained(OUT_DIR)``), and that training can start
from with ``model.init_from_hf=OUT_DIR``.

    lit-titan export runs/my-run/checkpoints/step-000100 hf/my-model
    lit-titan export CKPT OUT --dtype bf16 --max-shard-size 2GB
    lit-titan export CKPT OUT --model llama3_debug model.dim=64 model.n_layers=2

The model's shape comes from the run's ``config.yaml`` (``<run_dir>/config.yaml``, beside
``<run_dir>/checkpoints/``), or from ``--model FLAVOR [model.KEY=VALUE ...]`` (a group's keys too:
``model.moe.num_experts=8``). State the Hugging Face format cannot hold (Qwen3-MoE's expert bias) is
left out, with one line saying so. One process, no process group: only the model tensors are read
(never the optimizer state), one output shard at a time, so memory stays near one shard.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from lit_titan.errors import ConfigError, UserError
from lit_titan.models import hf_io, registry
from lit_titan.models.init import canonical_name
from lit_titan.models.registry import ModelArgsLike as ModelArgs

MODEL_OVERRIDE = re.compile(r"model(\.\w+)+=.*")  # model.KEY=V and a group's model.GROUP.KEY=V, as train takes
MODEL_PREFIX = "state_dict.model."  # where Lightning's DCP checkpoints keep the model's weights
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class ExportError(UserError):
    """Input the export cannot use; the message names the fix."""


USER_ERRORS = (ExportError, ConfigError, FileNotFoundError)


# ---- reading the checkpoint ----------------------------------------------------------------------
def check_checkpoint(ckpt: Path) -> None:
    if not ckpt.exists():
        raise FileNotFoundError(
            f"checkpoint {ckpt} does not exist; pass a checkpoint directory such as <run_dir>/checkpoints/step-XXXXXX"
        )
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt} is not a sharded (DCP) checkpoint directory written by lit-titan training")
    if not (ckpt / ".metadata").is_file():
        raise ExportError(
            f"{ckpt} is not a complete checkpoint (no .metadata: the save was interrupted?); "
            f"choose another checkpoint in {ckpt.parent}"
        )
    from lit_titan.checkpoint import CheckpointError
    from lit_titan.checkpoint.layout import verify_checksums

    try:  # when the checkpoint has checksums.json (re-reads it once); entries are read by SafeLoadPlanner
        verify_checksums(ckpt)
    except CheckpointError as err:
        raise ExportError(f"{err}; choose another checkpoint in {ckpt.parent}") from None


def model_tensor_metadata(ckpt: Path) -> dict[str, tuple[str, Any]]:
    """Our parameter name -> (its DCP key, its TensorStorageMetadata); optimizer state is skipped."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _reader(ckpt).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unreadable .metadata means "not a checkpoint"
        raise ExportError(f"{ckpt}/.metadata is not a readable DCP checkpoint ({type(err).__name__})") from err
    found = {
        canonical_name(k[len(MODEL_PREFIX) :]): (k, m)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)
    }
    if not found:
        raise ExportError(f"{ckpt} holds no model weights (no '{MODEL_PREFIX}*' tensors)")
    return found


def load_tensors(ckpt: Path, wanted: dict[str, tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Read the full tensors named in ``wanted`` (our name -> (DCP key, metadata)), in one process."""
    import torch.distributed.checkpoint as dcp

    buffers = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in wanted.values()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        from lit_titan.checkpoint.layout import SafeLoadPlanner

        dcp.load(buffers, storage_reader=_reader(ckpt), planner=SafeLoadPlanner(ckpt), no_dist=True)
    return {name: buffers[key] for name, (key, _) in wanted.items()}


def _reader(ckpt: Path) -> Any:
    """DCP's reader with lit-titan's allow-list unpickler for ``.metadata`` (no pickled code runs)."""
    from lit_titan.checkpoint.layout import SafeFileSystemReader

    return SafeFileSystemReader(str(ckpt))


# ---- the model config ----------------------------------------------------------------------------
def resolve_model_args(ckpt: Path, flavor: str | None, overrides: list[str]) -> ModelArgs:
    """From ``--model FLAVOR`` (+ overrides), else the run's ``config.yaml`` (+ overrides)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from lit_titan.config import compose
    from lit_titan.config.spec import model_args

    bad = [o for o in overrides if not MODEL_OVERRIDE.fullmatch(o)]
    if bad:
        raise ExportError(
            f"unexpected argument(s) {bad}; only model.KEY=VALUE overrides (model.moe.KEY=VALUE for a group) "
            f"may follow OUT_DIR"
        )
    if flavor:
        cfg = compose([f"model={flavor}", *overrides], check=True)
    else:
        config_yaml = ckpt.resolve().parent.parent / "config.yaml"
        if not config_yaml.is_file():
            raise FileNotFoundError(
                f"no run config at {config_yaml} (train.py writes <run_dir>/config.yaml); "
                f"pass the model: --model FLAVOR [model.KEY=VALUE ...]"
            )
        try:
            cfg = OmegaConf.merge(OmegaConf.load(config_yaml), OmegaConf.from_dotlist(overrides))
        except (OmegaConfBaseException, ValueError) as err:
            raise ExportError(f"cannot read the model config from {config_yaml}: {err}") from err
    try:
        args = model_args(cfg)
        adapter = registry.hf_adapter(args, "export")
    except (ValueError, OmegaConfBaseException) as err:
        raise ConfigError(str(err)) from err
    adapter.check_hf_expressible(args, "export")
    return args


def param_shapes(args: ModelArgs) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(parameter name -> shape in the model's order, other names a checkpoint may hold: a tied head's
    alias, and buffers such as the expert bias, which a run with other settings checkpoints)."""
    with torch.device("meta"):
        model = registry.build_model(args)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    others = set(model.state_dict()) | {canonical_name(n) for n, _ in model.named_buffers()}
    return shapes, others - set(shapes)


def check_shapes(tensors: dict[str, tuple[str, Any]], args: ModelArgs) -> None:
    """The checkpoint holds exactly the model's parameters, with its shapes."""
    expected, aliases = param_shapes(args)
    missing = sorted(set(expected) - set(tensors))
    # A tied head shares the embedding's weight: a state dict may list it under both names.
    extra = sorted(set(tensors) - set(expected) - aliases)
    wrong = [
        f"{n} {list(tensors[n][1].size)} vs {list(s)}"
        for n, s in expected.items()
        if n in tensors and tuple(tensors[n][1].size) != s
    ]
    if missing or extra or wrong:
        detail = "; ".join(
            part
            for part in (
                f"missing {missing[:4]}" if missing else "",
                f"unexpected {extra[:4]}" if extra else "",
                f"shapes (checkpoint vs config) {wrong[:4]}" if wrong else "",
            )
            if part
        )
        raise ExportError(
            f"the checkpoint does not match the model config ({detail}); "
            f"pass the run's model: --model FLAVOR model.KEY=VALUE ..."
        )


# ---- writing -------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ExportError(f"--max-shard-size={text!r} is not a size; use e.g. 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def write_hf_dir(
    ckpt: Path,
    out: Path,
    tensors: dict[str, tuple[str, Any]],
    args: ModelArgs,
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> None:
    """Shards planned from the metadata, then read, converted and written one at a time."""
    adapter = registry.hf_adapter(args, "export")
    out.mkdir(parents=True)
    order = list(param_shapes(args)[0])  # the model's own order: embedding, layers, norm, head
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {n: tensors[n][1].size.numel() * itemsize for n in order}
    shards = hf_io.plan_shards(sizes, max_shard_bytes)
    names = hf_io.shard_names(len(shards))
    weight_map: dict[str, str] = {}
    for shard, filename in zip(shards, names):
        full = load_tensors(ckpt, {n: tensors[n] for n in shard})
        converted = dict(adapter.iter_hf_tensors(full, args, dtype))
        hf_io.write_shard(out / filename, converted)
        weight_map.update({k: filename for k in converted})
        del full, converted
    if len(shards) > 1:
        hf_io.write_index(out, weight_map, sum(sizes.values()))
    hf_io.write_config(out, adapter.hf_config(args, dtype))


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT_DIR {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"OUT_DIR {out} is not empty; choose a new directory or pass --overwrite")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished export into place, so OUT_DIR never holds a half-written model."""
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(tmp, out)


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 10**9,
    model: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    overwrite: bool = False,
) -> Path:
    """Library entry point: every input is checked before anything is written."""
    ckpt, out = Path(ckpt).expanduser(), Path(out).expanduser().resolve()
    check_checkpoint(ckpt)
    tensors = model_tensor_metadata(ckpt)
    args = resolve_model_args(ckpt, model, list(overrides))
    check_shapes(tensors, args)
    _prepare_out(out, overwrite)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_hf_dir(ckpt, tmp, tensors, args, dtype, max_shard_bytes)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note = registry.hf_adapter(args, "export").export_note(args)
    if note:
        print(f"lit-titan: {note}", file=sys.stderr, flush=True)
    return out


# ---- command line --------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every lit-titan entry point
        raise ExportError(
            f"{message} (usage: lit-titan export CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16] "
            f"[--max-shard-size 5GB] [--model FLAVOR model.KEY=VALUE ...])"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="lit-titan export",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("checkpoint", help="a DCP checkpoint directory, e.g. <run_dir>/checkpoints/step-XXXXXX")
    parser.add_argument("out", help="the Hugging Face directory to write (new or empty)")
    parser.add_argument("overrides", nargs="*", help="model.KEY=VALUE overrides of the model config")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of the written weights (default fp32: lossless; bf16 halves the size)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    from lit_titan.cli.usage import config_groups  # the flavors in conf/model/, so the list cannot drift

    parser.add_argument(
        "--model",
        default=None,
        help=f"model flavor ({', '.join(config_groups()['model'])}), when the run's config.yaml is not there",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    return parser.parse_intermixed_args(argv)  # options may come between positionals


def main(argv: list[str] | None = None) -> Path:
    """Run the export; bad input prints ``lit-titan: error: ...`` and exits 2 (SystemExit), writing nothing."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse_args(argv)
        return export_checkpoint(
            opts.checkpoint,
            opts.out,
            dtype=DTYPES[opts.dtype],
            max_shard_bytes=parse_size(opts.max_shard_size),
            model=opts.model,
            overrides=opts.overrides,
            overwrite=opts.overwrite,
        )
    except USER_ERRORS as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        from lit_titan.job.ranks import report_user_error

        report_user_error(err)
        raise SystemExit(2) from None


if __name__ == "__main__":
    out_dir = main()
    print(f"lit-titan: exported to {out_dir}")
