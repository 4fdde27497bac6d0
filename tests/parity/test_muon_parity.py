"""optim=muon: parity with one process under FSDP, TP, FSDP x TP, PP and HSDP, a resume across layouts,
and the planted bug of orthogonalising each shard on its own.

Muon's update is a function of the whole matrix (Newton-Schulz over all its singular values): an
update from each FSDP or TP shard alone is a different optimizer, which trains without an error and
only a comparison with one process shows. The parity regime of tests/support/parity.py (lr 1e-2,
clipping engaged every step, 8 steps; pre-clip gradients, clip norm, weights after steps 0, 4, 7,
losses), one shared one-process Muon reference (its hidden matrices on Muon, the embedding, head and
norms on AdamW).
"""

import html
import json
import re

import pytest
import torch

from helpers import losses, read_metrics
from parity import (
    MIN_LOSS_DROP,
    PARITY,
    RESUME_STEP,
    STEPS,
    TOL,
    check_case,
    measure,
    norms,
    run_dump,
    run_reference,
)

pytestmark = [pytest.mark.parity, pytest.mark.slow]

# lr 2e-2: at 1e-2 the loss fell by 0.42 only in the 8 steps (parity.MIN_LOSS_DROP is 0.5)
MUON = ["optim=muon", "optim.lr=2e-2"]
SAVE = [f"checkpoint.every_n_steps={RESUME_STEP}", "checkpoint.keep_last=0"]
LAYOUTS = {
    "dp4": ["cluster.devices=4"],
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "pp2": ["cluster.devices=2", "parallel.pp=2"],
    "hsdp2x2": ["cluster.devices=4", "parallel.dp_replicate=2"],
}
MUTANT, MUTANT_LAYOUT = "muon_orthogonalises_each_shard", "tp2"
MIN_MARGIN = 10.0
# relative loss difference allowed from bf16 optimizer states over the 8 steps; seen 1e-5 against fp32 states,
# 9.6e-7 between the resumed and the uninterrupted bf16 runs
BF16_LOSS = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worlds):
    return run_reference(worlds, tmp_path_factory.mktemp("muon-single"), extra=MUON)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layout_matches_single_process(layout, reference, tmp_path, worlds):
    assert len(losses(reference)) == STEPS
    run_dump(worlds, [*PARITY, *MUON, *LAYOUTS[layout], "checkpoint.enabled=false"], tmp_path)
    check_case(f"muon_{layout}", reference, tmp_path)


def test_muon_dp2_tp2_matches_and_its_checkpoint_resumes_on_one_process(reference, tmp_path, worlds):
    """FSDP x TP (each matrix split over both): parity; its step-4 checkpoint (Muon's momentum and AdamW's
    moments as FSDP x TP shards) resumed by one process continues with the uninterrupted run's steps 4-7."""
    run_dump(worlds, [*PARITY, *MUON, "cluster.devices=4", "parallel.tp=2", *SAVE], tmp_path / "dp2_tp2")
    check_case("muon_dp2_tp2", reference, tmp_path / "dp2_tp2")
    ckpt = tmp_path / "dp2_tp2" / "checkpoints" / f"step-{RESUME_STEP:06d}"
    resumed = tmp_path / "resumed"
    run_dump(worlds, [*PARITY, *MUON, "cluster.devices=1", "checkpoint.enabled=false", f"resume={ckpt}"], resumed)
    assert [int(r["step"]) for r in read_metrics(resumed)] == list(range(RESUME_STEP, STEPS))  # continues
    check_case("muon_resume_dp2_tp2_into_single", reference, resumed)


def test_muon_mutant_orthogonalising_each_shard_is_caught(reference, tmp_path, worlds):
    """tests/support/mutants: Newton-Schulz on each rank's shard; the tp2 case must miss by >= 10x."""
    run_dump(worlds, [*PARITY, *MUON, *LAYOUTS[MUTANT_LAYOUT], "checkpoint.enabled=false"], tmp_path, mutant=MUTANT)
    ratio, what = measure(f"muon_{MUTANT_LAYOUT}", reference, tmp_path).margin(TOL)
    print(f"{MUTANT}: {what}, margin {ratio:.3g}x")
    assert ratio >= MIN_MARGIN, f"{MUTANT} caught by {ratio:.3g}x only: {what}"


def test_muon_bf16_states_under_dp2_tp2_save_and_resume_on_one_process(reference, tmp_path, worlds):
    """optim.state_dtype=bf16 through the real entry point: FSDP x TP shards of bf16 states saved by DCP as
    bf16 and resumed by one process. Stochastic rounding draws noise per local shard, so neither run is
    bitwise the fp32 one: losses within BF16_LOSS of the fp32 reference's, and the resumed steps within it
    of the uninterrupted bf16 run's."""
    from torch.distributed.checkpoint import FileSystemReader

    bf16 = ["optim.state_dtype=bf16"]
    run_dump(worlds, [*PARITY, *MUON, *bf16, "cluster.devices=4", "parallel.tp=2", *SAVE], tmp_path / "dp2_tp2")
    ckpt = tmp_path / "dp2_tp2" / "checkpoints" / f"step-{RESUME_STEP:06d}"
    states = {
        k: m.properties.dtype
        for k, m in FileSystemReader(ckpt).read_metadata().state_dict_metadata.items()
        if "exp_avg" in k or "momentum_buffer" in k
    }
    assert states and set(states.values()) == {torch.bfloat16}, states
    resumed = tmp_path / "resumed"
    run_dump(
        worlds, [*PARITY, *MUON, *bf16, "cluster.devices=1", "checkpoint.enabled=false", f"resume={ckpt}"], resumed
    )
    ref, run, res = losses(reference), losses(tmp_path / "dp2_tp2"), losses(resumed)
    assert len(res) == STEPS - RESUME_STEP
    worst = max(abs(a - b) / b for a, b in zip(run, ref))
    worst_resumed = max(abs(a - b) / b for a, b in zip(res, run[RESUME_STEP:]))
    print(f"bf16 states: losses vs fp32 {worst:.2g}, resumed vs uninterrupted {worst_resumed:.2g}")
    assert 0 < worst < BF16_LOSS and worst_resumed < BF16_LOSS


def test_mup_dp2_tp2_matches_single_process(tmp_path, worlds):
    """model.mup at twice the base width under FSDP x TP: the per-group lrs (Muon's matrices at lr / sqrt(2),
    AdamW's embedding, head and norms at lr), the halved logits and the attention scale, against one process
    with the same settings. lr 5e-2 (at 2e-2 the loss fell by 0.36 only in the 8 steps) and clipping at 0.2:
    muP's halved logits give gradient norms of 0.28-0.32 (seen), under parity.CLIP at some steps. Its step-4
    checkpoint (the per-group lrs live in the optimizer's param groups) resumed by one process continues with
    the uninterrupted steps 4-7."""
    clip = 0.2
    mup = [*MUON, "optim.lr=5e-2", "model.mup=true", "model.mup_base_width=32"]
    mup.append(f"trainer.gradient_clip_val={clip}")
    off = "checkpoint.enabled=false"
    reference = run_dump(worlds, [*PARITY, *mup, off, "cluster.devices=1"], tmp_path / "single")
    run_dump(worlds, [*PARITY, *mup, *SAVE, "cluster.devices=4", "parallel.tp=2"], tmp_path / "dp2_tp2")
    ref_losses = losses(reference)
    assert ref_losses[0] - ref_losses[-1] >= MIN_LOSS_DROP, ref_losses
    assert min(norms(reference / "dump").values()) > clip, "clipping never engaged in the reference"
    ratio, what = measure("mup_muon_dp2_tp2", reference, tmp_path / "dp2_tp2").margin(TOL)
    assert ratio <= 1.0, f"muP under dp2 x tp2: parity broken: {what}"
    ckpt = tmp_path / "dp2_tp2" / "checkpoints" / f"step-{RESUME_STEP:06d}"
    resumed = run_dump(worlds, [*PARITY, *mup, off, "cluster.devices=1", f"resume={ckpt}"], tmp_path / "resumed")
    assert [int(r["step"]) for r in read_metrics(resumed)] == list(range(RESUME_STEP, STEPS))  # continues
    ratio, what = measure("mup_resume_dp2_tp2_into_single", reference, resumed).margin(TOL)
    assert ratio <= 1.0, f"muP resumed from dp2 x tp2 on one process: parity broken: {what}"


def test_the_report_plots_muons_update_rms_per_layer_group(reference, tmp_path):
    """The one-process Muon run's metrics hold optim/update_rms/<group> at every logged step (measured during
    that step's update), and its report draws them: the hidden matrices' near AdamW's ~0.2 (Moonlight's
    scaling; seen 0.17-0.2), AdamW's groups about 1 or less (m_hat / sqrt(v_hat), 1 at the first step)."""
    import shutil

    from lit_titan.report import make_report

    rows = [r for r in read_metrics(reference) if r.get("optim/update_rms/hidden")]
    assert len(rows) == STEPS, rows
    run = tmp_path / "run"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("report.html", "checkpoints", "dump"))
    page = make_report(run).read_text()
    found = re.search(r"<figure id='fig-update_rms' data-series=\"([^\"]*)\">", page)
    series = json.loads(html.unescape(found.group(1)))["series"]
    assert set(series) == {f"optim/update_rms/{g}" for g in ("hidden", "embedding_head", "norms")}, set(series)
    hidden = series["optim/update_rms/hidden"]["y"]
    assert len(hidden) == STEPS and all(0.1 < v < 0.3 for v in hidden), hidden
    assert all(0 < v < 1.5 for g in ("embedding_head", "norms") for v in series[f"optim/update_rms/{g}"]["y"])
