"""The dry-run planner: TitanStrategy.parallelize on a meta model over a fake process group."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from helpers import run_job
from lit_titan.planner import REQUIRED_KEYS
from paths import ROOT

PER_RANK_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "total_bytes")


@pytest.fixture(scope="module")
def plan_405b(tmp_path_factory):
    """The 405B recipe on 512 H100s through the CLI, timed end to end (interpreter start included) in CPU
    seconds of the command's processes: a loaded machine stretches its wall time, not this."""
    import resource

    run_dir = tmp_path_factory.mktemp("plan405")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run_job(
        [sys.executable, "-m", "lit_titan.cli", "plan", "+recipe=llama3_405b_h100_512", f"run_dir={run_dir}"],
        cwd=ROOT,
        timeout=120,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    elapsed = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fits:" in proc.stdout
    # Nothing but our own line on stderr: no dependency warning (lit_titan/known_warnings.py)
    assert [line for line in proc.stderr.splitlines() if not line.startswith("Float8 (")] == [], proc.stderr
    return json.loads((run_dir / "plan.json").read_text()), elapsed


def test_405b_on_512_recipe(plan_405b):
    plan, elapsed = plan_405b
    assert elapsed < 60, f"405B plan took {elapsed:.1f} s of CPU"
    for key in REQUIRED_KEYS:
        assert key in plan
    for key in PER_RANK_KEYS:
        assert isinstance(plan["per_rank"][key], int) and plan["per_rank"][key] > 0
    assert plan["world_size"] == 512
    assert plan["mesh"] == {"pp": 8, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 8}
    assert plan["params_total"] == 405_853_388_800
    assert isinstance(plan["fits"], bool)
    assert plan["flops_per_token"] > 6 * 400e9
    pr = plan["per_rank"]
    assert pr["total_bytes"] == sum(
        pr[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "fsdp_buffer_bytes")
    )
    # fp32 master weights, grads alike, AdamW two fp32 states
    assert pr["param_dtype"] == "float32"
    assert pr["param_bytes"] == 4 * pr["param_numel"]
    assert pr["grad_bytes"] == pr["param_bytes"] and pr["optimizer_bytes"] == 2 * pr["param_bytes"]
    # The pipeline split covers the model exactly once.
    stages = plan["per_pp_rank"]
    assert sum(s["params_unsharded"] for s in stages) == plan["params_total"]
    assert sum(s["layers"] for s in stages) == 126
    # Rank 0's sharded tensors: its stages' parameters / (dp_shard * tp), except the RMSNorm weights,
    # which sequence parallel keeps replicated over tp (sharded by FSDP only). Exact.
    dim, fsdp, tp = 16384, 8, 8
    norms = stages[0]["layers"] * 2 * dim
    assert pr["param_numel"] == (stages[0]["params_unsharded"] - norms) // (fsdp * tp) + norms // fsdp
    # ... and within the pipeline's imbalance (rank 0: 15 of 126 blocks + embedding) of the even split.
    even = plan["params_total"] * 4 / (fsdp * tp * 8)
    assert abs(pr["param_bytes"] - even) / even < 0.03


def test_405b_placements_come_from_titan_strategy(plan_405b):
    """TP (colwise wq / rowwise w2) then FSDP dim-0 sharding, as TitanStrategy.parallelize applies them."""
    plan, _ = plan_405b
    ex = plan["per_rank"]["example_parameters"]
    wq = ex["layers.0.attention.wq.weight"]
    assert wq["global_shape"] == [16384, 16384]
    assert wq["local_shape"] == [16384 // 8 // 8, 16384]  # dim / tp / dp_shard
    assert wq["placements"][-1] == "S(0)"  # ColwiseParallel on the tp dim
    w2 = ex["layers.0.feed_forward.w2.weight"]
    assert w2["local_shape"] == [16384 // 8, 53248 // 8]  # FSDP on dim 0, RowwiseParallel on dim 1
    assert w2["placements"] == ["S(0)", "S(1)"]
    assert plan["pipeline"] == {
        "schedule": "Interleaved1F1B",
        "stages_per_rank": 2,
        "microbatches": 32,
        "num_stages": 16,
    }
    assert plan["per_rank"]["stage_ids"] == [0, 8]
    assert plan["transforms"]["activation_checkpointing"] == "full"
    assert plan["transforms"]["float8_linears"] > 0
    assert 0 < plan["perf"]["mfu_bound"] < 1


def test_8b_on_one_node_fits(tmp_path):
    from lit_titan.cli.plan import make_plan

    plan = make_plan(
        ["+recipe=llama3_8b_h100_8", "data.micro_batch_size=1", "data.global_batch_size=8", f"run_dir={tmp_path}"]
    )
    assert plan["fits"] is True, plan["reasons"]
    assert plan["mesh"]["dp_shard"] == 8 and plan["world_size"] == 8
    assert plan["params_total"] == 8_030_261_248
    assert plan["per_rank"]["param_bytes"] == plan["params_total"] * 4 // 8  # every dim divides by 8
    assert json.loads((tmp_path / "plan.json").read_text())["fits"] is True


def test_405b_on_one_node_does_not_fit(tmp_path):
    from lit_titan.cli.plan import make_plan

    plan = make_plan(
        ["model=llama3_405b", "cluster=h100_8", "data.seq_len=8192", "data.global_batch_size=8", f"run_dir={tmp_path}"]
    )
    assert plan["fits"] is False
    assert any("memory" in r and "+ AdamW " in r for r in plan["reasons"])
    assert plan["per_rank"]["total_bytes"] > 80 * 1024**3
    # the line names the optimizer whose states it counts
    muon = make_plan(
        [
            "model=llama3_405b",
            "cluster=h100_8",
            "data.seq_len=8192",
            "data.global_batch_size=8",
            "optim=muon",
            f"run_dir={tmp_path / 'muon'}",
        ]
    )
    assert any("memory" in r and "+ Muon " in r for r in muon["reasons"]), muon["reasons"]


def test_invalid_layouts_are_reasons_not_crashes(tmp_path):
    from lit_titan.cli.plan import make_plan

    # tp=16 does not divide Llama 3.1's 8 kv heads
    plan = make_plan(
        [
            "model=llama3_70b",
            "cluster=h100_128",
            "parallel.tp=16",
            "data.seq_len=8192",
            "data.global_batch_size=64",
            f"run_dir={tmp_path}",
        ]
    )
    assert plan["fits"] is False
    assert any("n_kv_heads=8" in r for r in plan["reasons"])
    # degrees that do not multiply to the world size: no mesh can be built, still a plan
    plan = make_plan(
        [
            "model=llama3_8b",
            "cluster=h100_64",
            "parallel.tp=8",
            "parallel.dp_shard=3",
            "data.seq_len=8192",
            "data.global_batch_size=64",
            f"run_dir={tmp_path}",
        ]
    )
    assert plan["fits"] is False
    assert any("world size is 64" in r for r in plan["reasons"])
    assert plan["per_rank"]["total_bytes"] is None


RECIPES = sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_plans_and_fits(recipe, tmp_path):
    from lit_titan.cli.plan import make_plan

    plan = make_plan([f"+recipe={recipe}", f"run_dir={tmp_path}"])
    assert plan["fits"] is True and not plan["reasons"], plan["reasons"]
    mesh = plan["mesh"]
    # Analytic: rank 0's pipeline share of the parameters, fp32, split over FSDP (dp_shard x cp)
    # and TP; the sharded tensors also keep norm weights whole on each TP rank (well under 1%).
    unsharded = plan["per_pp_rank"][0]["params_unsharded"] if mesh["pp"] > 1 else plan["params_total"]
    analytic = unsharded * 4 / (mesh["dp_shard"] * mesh["cp"] * mesh["tp"])
    assert abs(plan["per_rank"]["param_bytes"] - analytic) / analytic < 0.01


def test_launch_dry_run_prints_the_profile_command(tmp_path, capsys):
    from lit_titan.cli.launch import main as launch

    one_node = launch(["--dry-run", "+recipe=llama3_8b_h100_8"])
    assert capsys.readouterr().out.strip() == one_node
    assert one_node.startswith("torchrun --nnodes=1 --nproc_per_node=8 --max-restarts=3")
    assert "-m lit_titan.train +recipe=llama3_8b_h100_8 resume=auto" in one_node
    fleet = launch(["--dry-run", "+recipe=llama3_405b_h100_512"])
    assert "#SBATCH --nodes=64" in fleet and "srun --kill-on-bad-exit=1 python -m lit_titan.train" in fleet
    assert "resume=auto" in fleet and "for attempt in" in fleet
    # through the command line: a layout that cannot work is one error line, exit 2
    bad = run_job(
        [sys.executable, "-m", "lit_titan.cli", "launch", "--dry-run", "cluster=h100_8", "parallel.tp=3"],
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and "lit-titan: error:" in bad.stderr


@pytest.mark.slow
def test_a_plan_change_shows_in_planner_and_training(tmp_path, worlds):
    """Planner and training parallelise through the same code: swap the embedding's TP style in the
    model plan (tests/support/scripts/plan_change.py) and both report the new placement; the stock planner
    still reports the old one. Training runs for real: 4 gloo processes, dp2 x tp2, in the reused
    4-process world; the planner in this process (both put the stock plan back when they return)."""
    from helpers import TINY
    from scripts.plan_change import main as plan_change

    layout = [*TINY, "cluster.devices=4", "parallel.tp=2", "trainer.max_steps=1", "checkpoint.enabled=false"]
    stock = _plan_examples(layout, tmp_path)
    out = {mode: tmp_path / f"{mode}.json" for mode in ("plan", "train")}
    plan_change(["plan", str(out["plan"]), *layout, f"run_dir={tmp_path / 'plan'}"])
    assert _plan_examples(layout, tmp_path) == stock  # the change did not outlive its run
    worlds.run(
        4,
        "scripts.plan_change:main",
        ["train", str(out["train"]), *layout, f"run_dir={tmp_path / 'train'}"],
        timeout=300,
    )
    planned, trained = (json.loads(out[m].read_text()) for m in ("plan", "train"))
    emb = "tok_embeddings.weight"
    assert stock[emb]["placements"][-1] == "S(0)"  # RowwiseParallel: the vocabulary on tp
    assert planned[emb]["placements"][-1] == "S(1)"  # the changed plan: the embedding dim on tp
    for name, got in planned.items():  # every example the planner reports is what training built
        assert trained[name] == {k: got[k] for k in ("placements", "local_shape")}, name
    assert planned[emb]["local_shape"] != stock[emb]["local_shape"]


def _plan_examples(overrides: list[str], tmp_path: Path) -> dict:
    from lit_titan.cli.plan import make_plan

    return make_plan([*overrides, f"run_dir={tmp_path / 'stock'}"], write=False)["per_rank"]["example_parameters"]


# ---- search -----------------------------------------------------------------------------------------

DEBUG_LAYOUTS = [
    dict(pp=2, dp_shard=2, tp=2, pp_schedule="Interleaved1F1B"),
    dict(pp=1, dp_shard=2, cp=2, tp=2),
    dict(pp=1, dp_replicate=2, dp_shard=2, tp=2),
    dict(pp=2, dp_shard=4, pp_schedule="1F1B"),
    # the MoE family (its layer counts and its plan: the MoE layer replicated over tp); layer 1 dense
    dict(model="qwen3_moe_debug", dp_shard=4, tp=2),
    # expert parallel: experts over ep, FSDP over efsdp (2 here; 1 under HSDP x cp), their own FSDP unit
    dict(model="qwen3_moe_debug", dp_shard=8, ep=4),
    dict(model="qwen3_moe_debug", dp_replicate=2, dp_shard=2, cp=2, ep=4),
]


@pytest.mark.parametrize("layout", DEBUG_LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_analytic_layout_matches_the_meta_build(layout):
    """The search's closed-form rank-0 layout equals what TitanStrategy.parallelize builds (fake PG, 8 ranks)."""
    from lit_titan.config import compose
    from lit_titan.config.spec import model_args, parallel_dims, pipeline_config
    from lit_titan.planner.analytic import analytic_layout
    from lit_titan.planner.build import build_layout

    layout = dict(layout)
    # a small vocabulary, so that a block (not the embedding) is the largest FSDP unit
    model = (
        [f"model={layout.pop('model')}", "model.mlp_only_layers=[1]", "model.vocab_size=512"]
        if "model" in layout
        else []
    )
    cfg = compose(
        [
            *model,
            "cluster.devices=8",
            "data.seq_len=64",
            "data.global_batch_size=16",
            "callbacks=[]",
            *(f"parallel.{k}={v}" for k, v in layout.items()),
        ]
    )
    args, dims = model_args(cfg), parallel_dims(cfg)
    built = build_layout(cfg, args, dims, [])
    ana = analytic_layout(args, dims, pipeline_config(cfg) if dims.pp > 1 else None, precision=str(cfg.precision))
    for key in (
        "params_total",
        "local_numel",
        "local_matrix_numel",
        "local_param_bytes",
        "fsdp_applied",
        "layers_on_rank",
        "stage_ids",
        "num_stages",
        "pp_rank_numel",
        "pp_rank_layers",
        "pp_rank_has_output",
        "largest_unit_numel",
        "expert_numel",
    ):
        assert getattr(ana, key) == getattr(built, key), key


def _search(overrides: list[str], **kw):
    from lit_titan.config import compose
    from lit_titan.planner.search import search

    return search(compose(overrides), overrides, **kw)


def test_search_puts_the_pipeline_across_a_slow_link():
    """Constructed case with a known answer: 2 nodes x 2 GPUs joined by a link 10^4 x slower than NVLink,
    memory to spare, many micro-batches. Pipeline parallelism is the only degree whose traffic (p2p) stays
    off the per-block collectives, so the best layout is pp2 across the nodes with the data/tensor
    parallelism inside each node; every layout that spans the nodes with FSDP/HSDP/TP/CP is slower."""
    cluster = [
        "cluster=h100_8",
        "cluster.devices=2",
        "cluster.num_nodes=2",
        "cluster.gpus_per_node=2",
        "cluster.inter_node_gbps=0.05",
        "cluster.fp8=false",
    ]
    res = _search([*cluster, "model=llama3_8b", "data.seq_len=2048", "data.global_batch_size=64"], confirm=1)
    best = res["winner"]
    assert best["mesh"]["pp"] == 2 and best["mesh"]["dp_replicate"] == 1, best["layout"]
    assert best["confirmed"]["fits"] is True
    assert res["fitting"] > 10 and len(res["top"]) == 10
    assert [r["tokens_per_sec_per_device"] for r in res["top"]] == sorted(
        (r["tokens_per_sec_per_device"] for r in res["top"]), reverse=True
    )
    assert res["runner_up_lost"].startswith("runner-up ")
    # the same search with the inter-node link as fast as NVLink: nothing forces the pipeline, no bubble wins
    fast = _search(
        [
            *cluster[:-2],
            "cluster.inter_node_gbps=450",
            "cluster.fp8=false",
            "model=llama3_8b",
            "data.seq_len=2048",
            "data.global_batch_size=64",
        ],
        confirm=0,
    )
    assert fast["winner"]["mesh"]["pp"] == 1, fast["winner"]["layout"]


def test_search_405b_on_512_cli(tmp_path):
    """`lit-titan plan search=true` for Llama 3.1 405B on 512 H100s: < 60 s of CPU (the search, its three
    confirming builds, and the interpreter's imports), a top-10 table and a winner command that composes."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = run_job(
        [
            sys.executable,
            "-m",
            "lit_titan.cli",
            "plan",
            "search=true",
            "model=llama3_405b",
            "cluster=h100_512",
            "data.seq_len=8192",
            "data.global_batch_size=256",
            f"run_dir={tmp_path}",
        ],
        cwd=ROOT,
        timeout=600,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cpu < 60, f"search took {cpu:.1f} s of CPU ({wall:.1f} s wall)"
    res = json.loads((tmp_path / "search.json").read_text())
    assert len(res["top"]) == 10 and res["candidates"] > 1000
    assert all(c["fits"] and c["param_bytes_built"] == c["param_bytes_analytic"] for c in res["confirmed"])
    assert "winner: lit-titan train " in proc.stdout and "runner-up" in proc.stdout
    from lit_titan.config import compose

    compose(res["command"].split()[3:])  # the printed overrides compose


def test_search_no_layout_fits_names_the_closest(tmp_path):
    proc = run_job(
        [
            sys.executable,
            "-m",
            "lit_titan.cli",
            "plan",
            "search=true",
            "model=llama3_405b",
            "cluster=h100_8",
            "data.seq_len=8192",
            "data.global_batch_size=8",
            f"run_dir={tmp_path}",
        ],
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if line.startswith("lit-titan: error:")]
    assert len(err) == 1, proc.stderr[-2000:]
    assert "closest is pp" in err[0] and "cluster.num_nodes" in err[0]


# ---- calibration ------------------------------------------------------------------------------------


def _fake_run(run_dir: Path, overrides: list[str], step_s: float, busy_s: float) -> None:
    """A run directory as training writes it (config.yaml, timeline/rank-0.csv) with given step times."""
    from lit_titan.callbacks.timeline import TIMELINE_COLUMNS
    from lit_titan.config import compose, to_yaml

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(compose(overrides)))
    (run_dir / "timeline").mkdir()
    rows = [",".join(TIMELINE_COLUMNS)]
    for step in range(1, 9):
        vals = {
            "step": step,
            "wall_s": step_s * (5 if step == 1 else 1),
            "forward_s": busy_s / 2,
            "backward_s": busy_s / 2,
        }
        rows.append(",".join(str(vals.get(c, 0)) for c in TIMELINE_COLUMNS))
    (run_dir / "timeline" / "rank-0.csv").write_text("\n".join(rows) + "\n")


def test_calibration_round_trip(tmp_path):
    """Step times generated by the model at known efficiencies -> calibrate -> the same efficiencies back,
    written to a file that plan.calibration=FILE reads into the plan and the search."""
    from lit_titan.cli.plan import main, make_plan
    from lit_titan.config import compose
    from lit_titan.planner.calibrate import load_calibration, predict
    from lit_titan.planner.estimate import Efficiencies

    truth = Efficiencies(compute=0.05, comm=0.02, overhead_s=0.01)
    layouts = {"dp2": ["cluster.devices=2"], "dp2tp2": ["cluster.devices=4", "parallel.tp=2"]}
    base = ["model=llama3_debug", "data.seq_len=256", "data.global_batch_size=8"]
    dirs = []
    for name, ov in layouts.items():
        step = predict(compose([*base, *ov]), truth)["step_s"]
        _fake_run(tmp_path / name, [*base, *ov], step, step - truth.overhead_s)
        dirs.append(str(tmp_path / name))
    out = tmp_path / "cal.yaml"
    cal = main([f"calibrate={','.join(dirs)}", f"plan.calibration={out}"])
    eff = load_calibration(out)
    assert cal["path"] == str(out)
    assert eff.compute == pytest.approx(truth.compute, rel=0.06)  # the grid's step is 6%
    assert eff.comm == pytest.approx(truth.comm, rel=0.06)
    assert eff.overhead_s == pytest.approx(truth.overhead_s, rel=1e-6)
    plan = make_plan([*base, "cluster.devices=2", f"plan.calibration={out}", f"run_dir={tmp_path / 'p'}"])
    assert plan["assumptions"]["efficiencies"]["compute"] == eff.compute
    assert plan["perf"]["step_s"] == pytest.approx(
        predict(compose([*base, "cluster.devices=2"]), eff)["step_s"], rel=1e-9
    )
    # the shipped TorchTitan calibration by name; a missing file is one clear line
    assert load_calibration("h100_torchtitan_202412").float8_linear_speedup > 1
    with pytest.raises(ValueError, match="plan.calibration=nope.yaml: no such file"):
        make_plan(["plan.calibration=nope.yaml"], write=False)


def test_published_comparison_table_is_pinned():
    """docs/benchmarks.md's TorchTitan table is what lit_titan.planner.published computes today, and the
    shipped calibration file holds the same fit (neither can drift silently)."""
    from lit_titan.planner.calibrate import load_calibration
    from lit_titan.planner.published import calibrate_8b, markdown_table

    table = markdown_table()
    assert table in (ROOT / "docs" / "benchmarks.md").read_text()
    fit, shipped = calibrate_8b(), load_calibration("h100_torchtitan_202412")
    assert shipped.compute == pytest.approx(fit.compute, rel=1e-9)
    assert shipped.float8_linear_speedup == pytest.approx(fit.float8_linear_speedup, rel=1e-9)


# ---- activation estimate vs measured memory ----------------------------------------------------
@pytest.mark.slow
def test_activation_estimate_matches_cpu_measurement():
    """The plan's per-rank activation bytes within 15% of rank 0's measured activation peak (fake
    process group, torch's MemTracker) for AC none / selective_op / full, tp2, cp2 and pp2."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "activation_memory_cpu", ROOT / "benchmarks" / "activation_memory_cpu.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = ["AC none", "AC selective_op", "AC full", "tp2", "cp2", "pp2 (1F1B, 2 micro-batches)"]
    rows = bench.run({name: bench.LAYOUTS[name] for name in names})
    assert len(rows) == len(names)
    bad = [(r["layout"], round(r["error"], 3)) for r in rows if abs(r["error"]) > bench.TOLERANCE]
    assert not bad, bench.table(rows)
    # the layouts differ as they should: checkpointing and splitting shrink what a rank holds
    got = {r["layout"]: r["measured_bytes"] for r in rows}
    assert got["AC full"] < got["AC selective_op"] < got["AC none"]
    assert got["tp2"] < 0.7 * got["AC none"] and got["cp2"] < 0.7 * got["AC none"]
