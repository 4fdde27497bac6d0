"""Loading at scale: ``model.init_from_hf`` reads each rank's slice of every tensor, not
whole tensors on every rank; and model code does not import the config layer."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

from lit_titan.cli import export
from lit_titan.models.llama3 import Transformer, get_flavor, hf
from paths import ROOT

TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512"]
ARGS = get_flavor("llama3_debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512)


# ---- reading one block of a tensor --------------------------------------------------------------
@pytest.mark.parametrize("rows", [(0, 64), (16, 16), (5, 22), (60, 4), (30, 3)])
def test_read_region_of_a_rotary_tensor_equals_the_cut_of_the_whole(tmp_path, rows):
    """Row blocks that start and end inside a head (uneven FSDP chunks) still un-permute correctly."""
    heads, head_dim, cols = 4, 16, 10
    ours = torch.randn(heads * head_dim, cols)
    save_file({"w": hf.interleaved_to_half(ours, heads)}, str(tmp_path / "w.safetensors"))
    (start, size), col = rows, (3, 5)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        got = hf.read_region(f.get_slice("w"), (start, col[0]), (size, col[1]), rotary_heads=heads)
        plain = hf.read_region(f.get_slice("w"), (start, col[0]), (size, col[1]))
    assert torch.equal(got, ours[start : start + size, col[0] : col[0] + col[1]])
    assert not torch.equal(plain, got)  # the rows really were un-permuted


# ---- a real 4-process run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A HF directory (3 safetensors files + index) holding the tiny model seeded 5, not the run's seed 0."""
    root = tmp_path_factory.mktemp("hf_source")
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(5)
    dcp.save(
        {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}},
        checkpoint_id=str(root / "ckpt"),
        no_dist=True,
    )
    return export.main(
        [str(root / "ckpt"), str(root / "hf"), "--model", "llama3_debug", *TINY_MODEL, "--max-shard-size", "300KB"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["dp_shard=4"], ["dp_shard=2", "tp=2"]], ids=["dp4", "dp2xtp2"])
def test_init_from_hf_reads_a_quarter_per_rank_at_world_4(hf_dir, tmp_path, layout, worlds):
    worlds.run(4, "scripts.hf_load:main", [str(tmp_path), str(hf_dir), "4", *layout], timeout=600)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    total = records[0]["total_bytes"]
    for rank, rec in enumerate(records):
        assert rec["wrong"] == [], (rank, rec["wrong"])  # every parameter equals the file's, exactly
        ratio = rec["bytes_read"] / (total / 4)
        print(
            f"{layout} rank {rank}: read {rec['bytes_read']} B of {total} B = {ratio:.3f} x total/4 "
            f"(holds {rec['local_param_bytes']} B)"
        )
        assert ratio <= 1.3, rec


# ---- one way down -------------------------------------------------------------------------------
def test_model_code_does_not_import_the_layers_above_it():
    """models/ may import models/, lit_titan.errors and lit_titan.settings (which import nothing of
    lit_titan) and the ParallelPlan type, nothing else of lit_titan."""
    allowed = ("lit_titan.models", "lit_titan.errors", "lit_titan.settings", "lit_titan.strategies.parallel_plan")
    root = ROOT / "lit_titan" / "models"
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            bad += [
                f"{path.relative_to(root)}: {n}"
                for n in names
                if n.startswith("lit_titan") and not n.startswith(allowed)
            ]
    assert bad == []
