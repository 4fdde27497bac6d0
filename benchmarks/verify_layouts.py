"""``lit-titan verify`` over the parity suite's layouts: verdict, worst entry and wall time of each, as a table.

    python benchmarks/verify_layouts.py                 # every layout, the markdown table on stdout
    python benchmarks/verify_layouts.py --only tp2 ep2  # some of them
    python benchmarks/verify_layouts.py --dry-run       # each layout shrunk and checked, nothing run

Each row is one ``python -m lit_titan.cli.verify`` command line (the user's command, both sides in processes
it starts) on the tiny job below; its wall time includes every interpreter start-up, which dominates here.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from helpers import TINY  # noqa: E402 - the test suite's tiny model, from its support folder

JOB = [*TINY, "seed=0", "optim.lr=1e-2", "trainer.gradient_clip_val=0.3"]
MOE = ["model=qwen3_moe_debug", "model.head_dim=16", "model.moe.hidden_dim=32", "model.moe.aux_loss=sequence"]
SIX = ["model.n_layers=6"]
LAYOUTS: dict[str, list[str]] = {
    "dp2_accum2": ["cluster.devices=2", "data.micro_batch_size=2"],
    "dp4_accum2": ["cluster.devices=4", "data.micro_batch_size=1"],
    "hsdp2x2_accum2": ["cluster.devices=4", "parallel.dp_replicate=2", "data.micro_batch_size=1"],
    "tp2": ["cluster.devices=2", "parallel.tp=2"],
    "dp2_tp2_accum2": ["cluster.devices=4", "parallel.tp=2", "data.micro_batch_size=2"],
    "pp2_1F1B_accum2": ["cluster.devices=2", "parallel.pp=2", "data.micro_batch_size=4"],
    "pp2xdp2_GPipe": ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=GPipe"],
    "pp2xdp2_Interleaved1F1B": ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
    "pp2xdp2_LoopedBFS": ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=LoopedBFS"],
    "pp2xtp2": ["cluster.devices=4", "parallel.pp=2", "parallel.tp=2"],
    "pp2xdp2_InterleavedZeroBubble": [
        *SIX,
        "cluster.devices=4",
        "parallel.pp=2",
        "parallel.pp_schedule=InterleavedZeroBubble",
    ],
    "pp2xdp2_ZBVZeroBubble": [*SIX, "cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
    "pp2xdp2_DualPipeV": [*SIX, "cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=DualPipeV"],
    "cp2_allgather": ["cluster.devices=2", "parallel.cp=2"],
    "cp2_ring": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2_ulysses": ["cluster.devices=2", "parallel.cp=2", "parallel.cp_mode=ulysses"],
    "cp2xdp2_accum2": ["cluster.devices=4", "parallel.cp=2", "data.micro_batch_size=2"],
    "cp2xtp2": ["cluster.devices=4", "parallel.cp=2", "parallel.tp=2"],
    "pp2xcp2xtp2": ["cluster.devices=8", "parallel.pp=2", "parallel.cp=2", "parallel.tp=2"],
    "moe_ep2": [*MOE, "cluster.devices=2", "parallel.ep=2"],
    "moe_ep2xdp2": [*MOE, "cluster.devices=4", "parallel.ep=2"],
    "moe_hsdp2xep2_accum2": [
        *MOE,
        "cluster.devices=4",
        "parallel.dp_replicate=2",
        "parallel.ep=2",
        "data.micro_batch_size=1",
    ],
    "moe_ep2xtp2": [*MOE, "cluster.devices=4", "parallel.ep=2", "parallel.tp=2"],
    "moe_cp2xep2": [*MOE, "cluster.devices=2", "parallel.cp=2", "parallel.ep=2"],
    "moe_pp2xep2": [*MOE, "cluster.devices=4", "parallel.pp=2", "parallel.ep=2"],
}


def dry_run(names: list[str]) -> list[str]:
    """Each layout composed and shrunk, its verify keys and inputs checked: the rows a real run would have."""
    from lit_titan.config import compose
    from lit_titan.verify.check import describe
    from lit_titan.verify.shrink import shrink

    rows = []
    for name in names:
        argv = [*JOB, *LAYOUTS[name]]
        shrunk = shrink(compose(argv, check=True), argv, steps=3, precision="64-true", world_on_one_host=True)
        rows.append(f"| {name} | {describe(shrunk)} | not run | | |")
    return rows


def run(names: list[str], out: Path) -> list[str]:
    rows = []
    for name in names:
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "lit_titan.cli.verify", *JOB, *LAYOUTS[name], f"run_dir={out / name}"],
            capture_output=True,
            text=True,
            check=False,
        )
        seconds = time.monotonic() - start
        text = proc.stdout
        layout = re.search(r"lit-titan verify: (.*) against one process", text)
        worst = re.search(r"worst: (.*): ([0-9.e+-]+) of the tolerance", text)
        verdict = "PASS" if "verdict: PASS" in text else f"FAIL (exit {proc.returncode})"
        rows.append(
            f"| {name} | {layout.group(1) if layout else '?'} | {verdict} | "
            f"{worst.group(1) if worst else (proc.stderr.strip().splitlines() or ['?'])[-1]} | {seconds:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="layout names (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="shrink and check each layout, run nothing")
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary one)")
    args = parser.parse_args()
    names = args.only or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]}; choose from {', '.join(LAYOUTS)}")
    header = [
        "| layout | as verify names it | verdict | worst entry (error, tolerance) | wall s |",
        "|---|---|---|---|---:|",
    ]
    print("\n".join(header), flush=True)
    if args.dry_run:
        print("\n".join(dry_run(names)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(names, args.out or Path(tmp))
    failed = [r for r in rows if "| PASS |" not in r]
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
