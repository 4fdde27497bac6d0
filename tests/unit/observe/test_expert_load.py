"""MoE expert load in the metrics and the run report (observe/expert_load.py, report/figures.py)."""

from __future__ import annotations

import html
import json
import re

import pytest
import torch

from helpers import TINY, read_metrics

MOE_EP2 = [
    *TINY,
    "model=qwen3_moe_debug",
    "model.head_dim=16",
    "model.moe.hidden_dim=32",
    "model.moe.aux_loss=global",
    "model.moe.aux_loss_coef=0.01",
    "cluster.devices=2",
    "parallel.ep=2",
    "seed=0",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0",
    "checkpoint.enabled=false",
    "callbacks=[]",
]


def test_expert_load_is_max_over_mean_of_the_counts_summed_over_the_group():
    from lit_titan.models.moe import MoE, MoEArgs
    from lit_titan.observe.expert_load import expert_load_metrics

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    for i in (0, 2):  # block 1 is dense
        model.layers[i].moe = MoE(8, MoEArgs(num_experts=4, top_k=2, hidden_dim=16))
    model.layers[0].moe.last_counts = torch.tensor([3.0, 1.0, 0.0, 0.0])  # mean 1, max 3
    model.layers[2].moe.last_counts = torch.tensor([2.0, 2.0, 2.0, 2.0])
    out = expert_load_metrics(model)
    assert {k: float(v) for k, v in out.items()} == {"moe/load_max_mean/layer0": 3.0, "moe/load_max_mean/layer2": 1.0}
    assert expert_load_metrics(torch.nn.Linear(2, 2)) == {}


def test_report_of_an_moe_run_plots_expert_load_and_aux_loss(worlds, tmp_path):
    """A tiny Qwen3-MoE at ep2 (two gloo ranks, the reused world): every logged step has each MoE layer's
    max/mean tokens per expert (counts summed over both ranks) and the auxiliary loss; the report plots
    exactly those numbers."""
    from lit_titan.report import make_report

    run_dir = tmp_path / "moe"
    worlds.train(MOE_EP2, run_dir)
    rows = [r for r in read_metrics(run_dir) if r.get("train/loss")]
    assert len(rows) == 3
    for layer in (0, 1):
        ratio = [float(r[f"moe/load_max_mean/layer{layer}"]) for r in rows]
        assert all(1.0 <= x <= 4.0 for x in ratio), ratio  # 8 experts, top 2: at most all tokens on 2 of 8
    page = make_report(run_dir).read_text()
    found = re.findall(r"<figure id='fig-([a-z_]+)' data-series=\"([^\"]*)\">", page)
    figs = {name: json.loads(html.unescape(data)) for name, data in found}
    load = figs["expert_load"]["series"]
    assert sorted(load) == ["layer0", "layer1"]
    steps = [int(r["step"]) + 1 for r in rows]
    for layer in (0, 1):
        assert load[f"layer{layer}"]["x"] == steps
        expected = [float(r[f"moe/load_max_mean/layer{layer}"]) for r in rows]
        assert load[f"layer{layer}"]["y"] == pytest.approx(expected, rel=1e-7)
    aux = figs["aux_loss"]["series"]["train/aux_loss"]
    assert aux["y"] == pytest.approx([float(r["train/aux_loss"]) for r in rows], rel=1e-7) and min(aux["y"]) > 0
