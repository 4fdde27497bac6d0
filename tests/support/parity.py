"""Gradient-level parity harness: what a run computed, dumped at chosen steps, compared with one process.

Why gradients and not losses: under AdamW a uniform gradient-scale error (a loss scale that forgets
accumulation, FSDP summing instead of averaging) trains to the same losses, because Adam's
m / sqrt(v) cancels the scale; and near the initial weights attention barely moves the loss. The
full gradient of every parameter before clipping, the global norm clipping used, and the weights
after the step show both.

The dump and the comparison are the library's (lit_titan/verify/: what ``lit-titan verify`` runs); this
file holds the suite's regime, its cases and their runs.

``train_case`` runs in a reused world (tests/support/world.py): the real entry point
(``lit_titan.cli.hydra_app.run_app`` with ``lit_titan.job.run.train``) with the callback added, optionally
with a mutant (tests/support/mutants/) applied for the case and undone afterwards.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from helpers import TINY
from lit_titan.verify.compare import Report, Tolerance, compare, load_dumps, norms
from lit_titan.verify.dump import ParityDump, single_device_name
from lit_titan.verify.report import TOLERANCES

__all__ = ["ParityDump", "Report", "Tolerance", "compare", "load_dumps", "norms", "single_device_name"]


def verify_side_case(
    argv: list[str], run_dir: str, steps: list[int], known_norm_step: int | None, mutant: str | None = None
) -> dict[str, Any]:
    """One side of ``lit-titan verify`` (``lit_titan.cli.verify_side.run_side``), a mutant applied if named."""
    from lit_titan.cli.verify_side import run_side
    from mutants import applied

    with applied(mutant):
        return run_side(argv, run_dir, steps, known_norm_step)


def train_case(argv: list[str], out_dir: str, steps: list[int], mutant: str | None = None) -> dict[str, Any]:
    """``lit_titan.train.main(argv)`` with a ``ParityDump`` (and a mutant, if named) on every rank."""
    import shlex

    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.run import train
    from mutants import applied

    print(
        f"$ python -m lit_titan.train {shlex.join(argv)}  # parity dump at {sorted(steps)}, mutant={mutant}", flush=True
    )
    with applied(mutant):
        return run_app(argv, partial(train, callbacks=[ParityDump(out_dir, steps)]))


def known_norm_case(argv: list[str], mutant: str | None = None) -> dict[str, float]:
    """``lit_titan.train.main(argv)`` with a ``KnownNormCheck`` at step 0: the norm of all-ones gradients and the
    square root of the parameter count it must equal."""
    from lit_titan.callbacks.known_norm import KnownNormCheck
    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.run import train
    from mutants import applied

    check = KnownNormCheck(step=0)
    with applied(mutant):
        run_app(argv, partial(train, callbacks=[check]))
    return {"expected": check.expected, "measured": check.measured}


def replica_check_case(argv: list[str], mutant: str | None = None) -> dict[str, Any]:
    """``lit_titan.train.main(argv)`` with a ``ReplicaDivergenceCheck`` after every step, findings recorded."""
    from lit_titan.callbacks.replica_check import ReplicaDivergenceCheck
    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.run import train
    from mutants import applied

    check = ReplicaDivergenceCheck(every_n_steps=1, action="record")  # keys of ReplicaCheckConfig
    with applied(mutant):
        run_app(argv, partial(train, callbacks=[check]))
    return {"divergent": check.divergent, "checked": check.checked}


def run_user_case(worlds, module: str, overrides: list[str], run_dir: Path, mutant: str | None = None) -> Path:
    """``run_layout`` with a user's subclass (``tests/support/user_modules.py``, by name) as the job's module."""
    from world import devices_of

    argv = [*PARITY, "checkpoint.enabled=false", *overrides, f"run_dir={run_dir}"]
    worlds.run(
        devices_of(argv), "parity:train_user_case", module, argv, str(run_dir / "dump"), DUMP_STEPS, mutant, timeout=600
    )
    return run_dir


# The one-process reference of user_modules.MaskedLabels learns less than the shared one (0.44 in 8 steps, on about
# half the targets): the least drop its cases require of it.
MASKED_DROP = 0.3


def train_user_case(
    module: str, argv: list[str], out_dir: str, steps: list[int], mutant: str | None = None
) -> dict[str, Any]:
    """``train_case`` with a user's subclass (``tests/support/user_modules.py``, by name) as the job's module."""
    import lit_titan.module as lit_module
    import user_modules

    original = lit_module.PretrainModule
    lit_module.PretrainModule = getattr(user_modules, module)  # what job.build's build_module constructs
    try:
        return train_case(argv, out_dir, steps, mutant)
    finally:
        lit_module.PretrainModule = original


# ---- the shared regime and cases -----------------------------------------------------------------
# Where bugs show: lr 1e-2 (the reference's loss falls 6.63 -> 5.92 in 8 steps, so attention and every
# weight move), clipping engaged at every step (the reference's global norm is 0.55-0.62 > 0.3, so
# the clipped update depends on the norm over FSDP/TP shards and PP stages), float64: a correct layout
# differs from one process by summation order alone, so a planted bug misses by many orders of magnitude
# (fp32 itself is tested where it is the point: mixed precision, Float8).
STEPS = 8
CLIP = 0.3
MIN_LOSS_DROP = 0.4  # the reference must learn at least this much (measured in float64: dense 0.72, MoE 0.46)
PARITY = [
    *TINY,
    f"trainer.max_steps={STEPS}",
    "seed=0",
    "precision=64-true",
    "optim.lr=1e-2",
    "optim.warmup_steps=2",
    f"trainer.gradient_clip_val={CLIP}",
]
DUMP_STEPS = [0, 4, STEPS - 1]
RESUME_STEP = 4  # the reference saves a checkpoint here; resume cases continue from it

# lit-titan verify's float64 tolerances (lit_titan/verify/report.py): the noise floor of the cases below is in
# docs/testing.md, "Parity" (PARITY_RECORD=file python -m pytest -m parity writes every case's worst errors);
# every mutant (tests/support/mutants/) misses by >= 10x the tolerance, most by 1e9x.
TOL = TOLERANCES["64-true"][0]
# The fp32 tolerances (about 4x the fp32 noise floor of these cases), for the tests that train in fp32.
TOL32 = TOLERANCES["32-true"][0]

SIX_LAYERS = ["model.n_layers=6"]
# name -> overrides on top of PARITY. Every parallelism is combined with gradient accumulation at least once
# (data.micro_batch_size below the per-rank batch).
CASES: dict[str, list[str]] = {
    # FSDP / HSDP / TP (tests/parity/test_parallel.py)
    "dp2": ["cluster.devices=2"],
    "dp2_accum2": ["cluster.devices=2", "data.micro_batch_size=2"],
    "dp4_accum2": ["cluster.devices=4", "data.micro_batch_size=1"],
    "hsdp2x2_accum2": ["cluster.devices=4", "parallel.dp_replicate=2", "data.micro_batch_size=1"],
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "dp2_tp2_accum2": ["cluster.devices=4", "parallel.tp=2", "data.micro_batch_size=2"],
    "resume_dp2": ["cluster.devices=2"],  # + resume= the reference's step-4 checkpoint
    # pipeline (tests/parity/test_pipeline.py): each schedule family, with and without accumulation
    "pp2_1F1B_accum2": ["cluster.devices=2", "parallel.pp=2", "data.micro_batch_size=4"],
    "pp2xdp2_GPipe": ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=GPipe"],
    "pp2xdp2_1F1B": ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=1F1B"],
    "pp2xdp2_Interleaved1F1B_accum2": [
        "cluster.devices=4",
        "parallel.pp=2",
        "parallel.pp_schedule=Interleaved1F1B",
        "data.micro_batch_size=2",
        "parallel.pp_microbatches=2",
    ],
    "pp2xdp2_LoopedBFS": ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=LoopedBFS"],
    "pp2xtp2": ["cluster.devices=4", "parallel.pp=2", "parallel.tp=2"],
    "pp2xdp2xtp2_Interleaved1F1B": [
        "cluster.devices=8",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.pp_schedule=Interleaved1F1B",
    ],
    # zero-bubble schedules x FSDP (one stage's gradients silently wrong when FSDP reshards after
    # forward): six layers give each of the 4 stages two FSDP units, so a stage has a unit that could
    # reshard after forward. Their reference: PARITY + SIX_LAYERS.
    "pp2xdp2_InterleavedZeroBubble": [
        *SIX_LAYERS,
        "cluster.devices=4",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.pp_schedule=InterleavedZeroBubble",
    ],
    "pp2xdp2_ZBVZeroBubble": [
        *SIX_LAYERS,
        "cluster.devices=4",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.pp_schedule=ZBVZeroBubble",
    ],
    "pp2xdp2_DualPipeV": [
        *SIX_LAYERS,
        "cluster.devices=4",
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.pp_schedule=DualPipeV",
    ],
    "pp2_ZBVZeroBubble_accum2": [
        *SIX_LAYERS,
        "cluster.devices=2",
        "parallel.pp=2",
        "parallel.pp_schedule=ZBVZeroBubble",
        "data.micro_batch_size=4",
    ],
    # context parallel (tests/parity/test_context_parallel.py)
    "cp2": ["cluster.devices=2", "parallel.cp=2"],
    "cp4": ["cluster.devices=4", "parallel.cp=4"],
    "cp2xdp2_accum2": ["cluster.devices=4", "parallel.cp=2", "parallel.dp_shard=2", "data.micro_batch_size=2"],
    "cp2xtp2": ["cluster.devices=4", "parallel.cp=2", "parallel.tp=2"],
    "pp2xcp2xtp2": ["cluster.devices=8", "parallel.pp=2", "parallel.cp=2", "parallel.tp=2"],
    "dp2xcp2xpp2_Interleaved1F1B": [
        "cluster.devices=8",
        "parallel.pp=2",
        "parallel.cp=2",
        "parallel.dp_shard=2",
        "parallel.pp_schedule=Interleaved1F1B",
    ],
    # context-parallel modes (tests/parity/test_cp_modes.py; their mutants in tests/parity/test_mutants.py)
    "cp2_ring": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ulysses"],
}


def run_reference(worlds, run_dir: Path, extra: list[str] = ()) -> Path:
    """The one-process run every case compares with; it also saves the checkpoint resume cases start from."""
    overrides = [
        *PARITY,
        *extra,
        "cluster.devices=1",
        f"checkpoint.every_n_steps={RESUME_STEP}",
        "checkpoint.keep_last=0",
    ]
    worlds.run(
        1, "parity:train_case", [*overrides, f"run_dir={run_dir}"], str(run_dir / "dump"), DUMP_STEPS, timeout=600
    )
    return run_dir


def run_case(worlds, case: str, run_dir: Path, reference: Path, mutant: str | None = None) -> Path:
    overrides = [*PARITY, *CASES[case], "checkpoint.enabled=false"]
    if case.startswith("resume_"):
        overrides.append(f"resume={reference / 'checkpoints' / f'step-{RESUME_STEP:06d}'}")
    return run_dump(worlds, overrides, run_dir, mutant)


def run_dump(worlds, overrides: list[str], run_dir: Path, mutant: str | None = None) -> Path:
    """Any command line with the dump at DUMP_STEPS (from the resumed step on when it resumes)."""
    from world import devices_of

    resumed = any(o.startswith("resume=") for o in overrides)
    steps = [s for s in DUMP_STEPS if s >= RESUME_STEP] if resumed else DUMP_STEPS
    worlds.run(
        devices_of(overrides),
        "parity:train_case",
        [*overrides, f"run_dir={run_dir}"],
        str(run_dir / "dump"),
        steps,
        mutant,
        timeout=600,
    )
    return run_dir


def measure(case: str, reference: Path, got: Path) -> Report:
    """Worst loss, gradient, norm and weight errors of a case against the reference (at the steps it ran)."""
    from helpers import losses

    ref_losses, got_losses = losses(reference), losses(got)
    first = STEPS - len(got_losses)
    assert len(got_losses) == STEPS - first and first in (0, RESUME_STEP), got_losses
    report = compare(reference / "dump", got / "dump", steps=[s for s in DUMP_STEPS if s >= first])
    report.add("loss", max(abs(g - r) / r for g, r in zip(got_losses, ref_losses[first:])), "worst step")
    return report


def check_case(
    case: str, reference: Path, got: Path, tol: Tolerance = TOL, min_loss_drop: float = MIN_LOSS_DROP
) -> Report:
    """The reference learns with clipping engaged; losses, gradients, norms and weights match it."""
    import json
    import os

    from helpers import losses

    ref_losses = losses(reference)
    assert ref_losses[0] - ref_losses[-1] >= min_loss_drop, f"the reference did not learn: {ref_losses}"
    assert min(norms(reference / "dump").values()) > CLIP, "clipping never engaged in the reference"
    report = measure(case, reference, got)
    if os.environ.get("PARITY_RECORD"):  # the noise floor measurement (see TOL)
        with open(os.environ["PARITY_RECORD"], "a") as f:
            f.write(json.dumps({"case": case, **{k: v[0] for k, v in report.worst.items()}}) + "\n")
    ratio, what = report.margin(tol)
    assert ratio <= 1.0, f"{case}: parity broken: {what}\n  all: {report.summary()}"
    return report


def run_layout(
    worlds, overrides: list[str], run_dir: Path, mutant: str | None = None, steps: list[int] = DUMP_STEPS
) -> Path:
    """A run of ``PARITY + overrides`` with the dump, for a file whose cases are not in ``CASES`` (its own
    model setting, probe or reference); ``devices_of(overrides)`` picks the world."""
    from world import devices_of

    argv = [*PARITY, "checkpoint.enabled=false", *overrides, f"run_dir={run_dir}"]
    worlds.run(devices_of(argv), "parity:train_case", argv, str(run_dir / "dump"), steps, mutant, timeout=600)
    return run_dir


# ---- Mixture-of-Experts and expert parallel (tests/parity/test_expert_parallel.py) -------------------
# The tiny Qwen3-MoE (2 MoE layers of 8 experts, top 2) with both balancing methods on: the global-batch
# auxiliary loss (counts summed over the data/context ranks) and the auxiliary-loss-free expert bias
# (moved after every step from the whole step's counts, which changes the routing between steps).
MOE = [
    "model=qwen3_moe_debug",
    "model.head_dim=16",
    "model.moe.hidden_dim=32",
    "model.moe.aux_loss=global",
    "model.moe.aux_loss_coef=0.01",
    "model.moe.bias_update_rate=0.01",
]
# The sequence-wise auxiliary loss, for the accumulation cases: the global-batch and pooled losses count the
# tokens of one micro-batch (over the data/context ranks), so under gradient accumulation they are not the
# one-process loss of the whole batch (models/moe.py; the same without any parallelism; the global one is with
# model.moe.aux_loss_counts=step: ep2_accum2_global_step), while the
# sequence-wise loss is a mean over sequences, which accumulation keeps. These cases have their own reference.
SEQUENCE_AUX = ["model.moe.aux_loss=sequence"]
PP2 = ["cluster.devices=2", "parallel.pp=2"]
# name -> overrides on top of PARITY + MOE; ep borrows its ranks from dp_shard x cp.
EP_CASES: dict[str, list[str]] = {
    "ep2": ["cluster.devices=2", "parallel.ep=2"],
    "ep2_accum2": ["cluster.devices=2", "parallel.ep=2", "data.micro_batch_size=2", *SEQUENCE_AUX],
    # the global-batch loss under accumulation with the step's counts taken first (model.moe.aux_loss_counts=step),
    # every block recomputed in backward (its forward must not count again)
    "ep2_accum2_global_step": [
        "cluster.devices=2",
        "parallel.ep=2",
        "data.micro_batch_size=2",
        "model.moe.aux_loss_counts=step",
        "callbacks=[activation_checkpointing]",
        "callbacks.activation_checkpointing.mode=full",
    ],
    # dp_shard 4 = efsdp 2 x ep 2; saves the step-4 checkpoint the resume case starts from
    "ep2xdp2": [
        "cluster.devices=4",
        "parallel.ep=2",
        "checkpoint.enabled=true",
        f"checkpoint.every_n_steps={RESUME_STEP}",
        "checkpoint.keep_last=0",
    ],
    "hsdp2xep2_accum2": [
        "cluster.devices=4",
        "parallel.dp_replicate=2",
        "parallel.ep=2",
        "data.micro_batch_size=1",
        *SEQUENCE_AUX,
    ],
    "cp2xep2": ["cluster.devices=2", "parallel.cp=2", "parallel.ep=2"],
    # each cp rank holds 2 of the 4 chunks of every sequence: the per-sequence counts and score sums are
    # summed over cp (the scores' with autograd) before the sequence-wise loss
    "cp2xep2_sequence": ["cluster.devices=2", "parallel.cp=2", "parallel.ep=2", *SEQUENCE_AUX],
    # the experts split over ep x tp = 4 ranks, each tp rank dispatching half of the routed tokens
    "ep2xtp2": ["cluster.devices=4", "parallel.tp=2", "parallel.ep=2"],
    # pipeline: every MoE layer back-propagates its own share of the auxiliary loss (models/injected_loss.py);
    # pipeline micro-batches split the batch as accumulation does, hence the sequence-wise loss. An interleaved
    # schedule (4 stages: embedding | layer 0 | layer 1 | head) with accumulation, and a flat one with ep.
    "pp2_Interleaved1F1B_accum2": [
        "cluster.devices=2",
        "parallel.pp=2",
        "parallel.pp_schedule=Interleaved1F1B",
        "data.micro_batch_size=4",
        *SEQUENCE_AUX,
    ],
    "pp2xep2": ["cluster.devices=4", "parallel.pp=2", "parallel.ep=2", *SEQUENCE_AUX],
    # pp x ep x tp (8 ranks): the tp style's weight swap meets the experts' own FSDP unit, which the pipeline
    # leaves unsharded between micro-batches (mutant moe_tp_swaps_expert_weights)
    "pp2xep2xtp2": ["cluster.devices=8", "parallel.pp=2", "parallel.ep=2", "parallel.tp=2", *SEQUENCE_AUX],
    # the global-batch loss under pp with the step's counts taken first by the schedule's eval (aux_loss_counts=step)
    "pp2_Interleaved1F1B_accum2_global_step": [
        "cluster.devices=2",
        "parallel.pp=2",
        "parallel.pp_schedule=Interleaved1F1B",
        "data.micro_batch_size=4",
        "model.moe.aux_loss_counts=step",
    ],
    # the stage I/O and the all-gathered MoE input under tp; the cp sums of the sequence-wise loss inside a stage
    "pp2xtp2": ["cluster.devices=4", "parallel.pp=2", "parallel.tp=2", *SEQUENCE_AUX],
    "pp2xcp2": ["cluster.devices=4", "parallel.pp=2", "parallel.cp=2", *SEQUENCE_AUX],
    # the zero-bubble schedules split backward into input and weight gradients (the injected share must reach
    # the router in both), DualPipeV also overlaps one micro-batch's forward with another's backward
    "pp2_InterleavedZeroBubble": [*PP2, "parallel.pp_schedule=InterleavedZeroBubble", *SEQUENCE_AUX],
    "pp2_ZBVZeroBubble": [*PP2, "parallel.pp_schedule=ZBVZeroBubble", *SEQUENCE_AUX],
    "pp2_DualPipeV_accum2": [*PP2, "parallel.pp_schedule=DualPipeV", "data.micro_batch_size=4", *SEQUENCE_AUX],
    # the breadth-first schedules: every micro-batch's forward before any backward (GPipe), and looped stages
    # (LoopedBFS: 4 stages on 2 ranks, each rank's stages in turn)
    "pp2_GPipe": [*PP2, "parallel.pp_schedule=GPipe", *SEQUENCE_AUX],
    "pp2_LoopedBFS_accum2": [*PP2, "parallel.pp_schedule=LoopedBFS", "data.micro_batch_size=4", *SEQUENCE_AUX],
    # every block recomputed in backward: its dispatch and combine run again, its counts are not taken again
    "ep2_ac_full": [
        "cluster.devices=2",
        "parallel.ep=2",
        "callbacks=[activation_checkpointing]",
        "callbacks.activation_checkpointing.mode=full",
    ],
    # each block compiled (fullgraph; aot_eager: dynamo and AOT autograd, without inductor's build time)
    "ep2_compile": [
        "cluster.devices=2",
        "parallel.ep=2",
        "callbacks=[compile]",
        "callbacks.compile.backend=aot_eager",
        "callbacks.compile.fullgraph=false",
    ],
}


def run_ep_case(worlds, case: str, run_dir: Path, mutant: str | None = None) -> Path:
    return run_layout(worlds, [*MOE, *EP_CASES[case]], run_dir, mutant)
