"""Pipeline parallelism: stage split units, and parity of every schedule with one process."""

import pytest
import torch

from helpers import TINY, assert_losses_match, losses, read_metrics, run_cli
from lit_titan.models.llama3 import Transformer, get_flavor
from lit_titan.models.llama3.parallelize import pipeline_units
from lit_titan.strategies.pipeline import ZERO_BUBBLE, PipelineConfig, build_rank_model, split_units, stage_ids
from lit_titan.strategies.settings import PP_SCHEDULES as SCHEDULES
from parity import SIX_LAYERS, check_case, run_case, run_reference

STEPS = 5
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "seed=0", "precision=32-true", "checkpoint.enabled=false"]


# ---- split and placement (no processes) ----------------------------------------------------------
def _meta_model(n_layers=6):
    with torch.device("meta"):
        return Transformer(get_flavor("llama3_debug", n_layers=n_layers))


def test_balanced_split_counts_embedding_and_head_as_layers():
    units = pipeline_units(_meta_model(6))  # 8 units
    stages = split_units(units, 4)
    assert stages == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    assert split_units(units, 3)[0] == ["tok_embeddings", "layers.0", "layers.1"]


def test_explicit_split_is_checked():
    units = pipeline_units(_meta_model(2))
    ok = (("tok_embeddings", "layers.0"), ("layers.1", "norm", "output"))
    assert split_units(units, 2, ok) == [list(s) for s in ok]
    with pytest.raises(ValueError, match="every module once"):
        split_units(units, 2, (("tok_embeddings",), ("layers.1", "norm", "output")))
    with pytest.raises(ValueError, match="parallel.pp"):
        split_units(units, 5)


def test_stage_placement():
    assert stage_ids(0, 2, PipelineConfig("Interleaved1F1B")) == [0, 2]
    assert stage_ids(1, 2, PipelineConfig("Interleaved1F1B")) == [1, 3]
    assert stage_ids(0, 2, PipelineConfig("ZBVZeroBubble")) == [0, 3]  # V shape
    assert stage_ids(1, 4, PipelineConfig("DualPipeV")) == [1, 6]
    with pytest.raises(ValueError, match="pp_schedule"):
        PipelineConfig("Pipedream").validate()
    with pytest.raises(ValueError, match="2 stages per rank"):
        PipelineConfig("DualPipeV", stages_per_rank=3).validate()


def test_rank_model_keeps_original_names_and_views_share_parameters():
    model = _meta_model(6)
    units = pipeline_units(model)
    stages = split_units(units, 4)
    rank_model, views = build_rank_model(model, units, [stages[0], stages[3]])  # V-shaped rank 0
    names = {n for n, _ in rank_model.named_parameters()}
    assert "tok_embeddings.weight" in names and "output.weight" in names and "layers.5.ffn_norm.weight" in names
    assert not any(n.startswith(("layers.1.", "layers.3.")) for n in names)
    first, last = views
    assert first.output is None and last.tok_embeddings is None
    assert list(first.layers) == ["0"] and list(last.layers) == ["5"]
    assert first.layers["0"] is rank_model.layers["0"]  # shared, not copied
    assert rank_model.output is not None  # pruning a view does not touch the rank model


# ---- parity with one process (real gloo processes, tests/support/parity.py) --------------------------------
# Every schedule family (single-stage, looped, V-shaped) with FSDP inside the stages and, at least once,
# with gradient accumulation; pp2 x tp2 and a 3-D layout. Gradients, the clip norm over the stages and
# the weights against one process (parity.TOL): a loss comparison under AdamW cannot see a pipeline
# loss scale that forgets accumulation (Adam's m/sqrt(v) cancels a uniform scale); gradients can.
PARITY_CASES = [
    "pp2_1F1B_accum2",
    "pp2xdp2_GPipe",
    "pp2xdp2_1F1B",
    "pp2xdp2_Interleaved1F1B_accum2",
    "pp2xdp2_LoopedBFS",
    "pp2xtp2",
    "pp2xdp2xtp2_Interleaved1F1B",
]
# The zero-bubble schedules with FSDP (trap 1 moves one stage's gradients by ~1e-3 or drops them),
# against a six-layer reference.
ZERO_BUBBLE_CASES = [
    "pp2xdp2_InterleavedZeroBubble",
    "pp2xdp2_ZBVZeroBubble",
    "pp2xdp2_DualPipeV",
    "pp2_ZBVZeroBubble_accum2",
]
assert {c.split("_")[1] for c in ZERO_BUBBLE_CASES} == set(ZERO_BUBBLE)
# every schedule runs (1F1B also in pp2 x tp2, whose case name does not say it)
assert {c.split("_")[1] for c in PARITY_CASES + ZERO_BUBBLE_CASES if "_" in c} == set(SCHEDULES)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("case", PARITY_CASES)
def test_pipeline_matches_single_process(case, parity_reference, tmp_path, worlds):
    check_case(case, parity_reference, run_case(worlds, case, tmp_path, parity_reference))


@pytest.fixture(scope="module")
def six_layer_reference(tmp_path_factory, worlds):
    return run_reference(worlds, tmp_path_factory.mktemp("six-layers"), SIX_LAYERS)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("case", ZERO_BUBBLE_CASES)
def test_zero_bubble_schedules_match_single_process(case, six_layer_reference, tmp_path, worlds):
    check_case(case, six_layer_reference, run_case(worlds, case, tmp_path, six_layer_reference))


@pytest.mark.slow
@pytest.mark.parity
def test_checkpoint_from_pp2xdp2_resumes_under_dp2(tmp_path, worlds):
    steps = [*TINY, "trainer.max_steps=6", "seed=0", "precision=32-true", "checkpoint.every_n_steps=3"]
    worlds.train(
        [*steps, "cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"], tmp_path / "pp"
    )
    ckpt = tmp_path / "pp" / "checkpoints" / "step-000003"
    worlds.train([*steps, "cluster.devices=2", f"resume={ckpt}"], tmp_path / "dp")
    assert [int(r["step"]) for r in read_metrics(tmp_path / "dp")] == [3, 4, 5]
    assert_losses_match(losses(tmp_path / "dp"), losses(tmp_path / "pp")[3:], rtol=1e-5)


def test_microbatches_must_divide_the_rank_batch(tmp_path):
    proc = run_cli([*COMMON, "cluster.devices=2", "parallel.pp=2", "parallel.pp_microbatches=3"], tmp_path, check=False)
    assert proc.returncode == 2 and "parallel.pp_microbatches" in proc.stderr
    assert "Traceback" not in proc.stderr
