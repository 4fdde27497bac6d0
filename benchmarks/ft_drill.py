"""Repeated-fault drill: effective training time of restart + ``resume=auto`` against replica-group recovery.

CPU, gloo, 4 processes as dp_replicate 2 x dp_shard 2 (the parity regime's tiny model: dim 64, 2 layers, fp32,
lr 1e-2, clipping engaged), ``--steps`` optimizer steps, a fault every ``--kill-every`` seconds for ``--minutes``:

- ``restart``: SIGKILL one random rank; the launcher then ends the others and starts all 4 again (what torchrun's
  agent does, each attempt on a fresh store), and ``resume=auto`` reloads the newest checkpoint
  (``checkpoint.every_n_steps=--ckpt-every``): the steps since it are trained again.
- ``replica``: ``fault_tolerance.enabled=true``; SIGKILL both ranks of replica group 1; group 0 trains on (and trains
  group 1's samples), the launcher starts group 1 again and it rejoins with group 0's state (no checkpoint read).

A fault is fired only once the previous one is recovered (restart: a step trained after the resume; replica: the
group rejoined, ``membership.csv``), so an interval shorter than a recovery lowers the fault rate: the drill prints the
faults it fired. Effective training time = steps x the fault-free step time (the same layout and mode
uninterrupted, its wall time per step: ``reference`` for restart, ``replica-reference`` for replica) / the wall
time from the first step's end to the last step's end, plus one step (start-up excluded in every mode).
The final weights (``parity.ParityDump`` at the last step) are compared with the reference's: restart resumes
bitwise; replica recovery sums the gradients in another order, so within ``parity.TOL``.

The ranks are forked from this process (torch and the trainer imported once), which hosts the job's store, as
tests/support/scripts/ft_trainer.py does; each writes OUT/<mode>/rank-N-aA.log (A: its start). Run it as
``python benchmarks/ft_drill.py --mode all --minutes 3 --kill-every 30 --ckpt-every 20 --steps 200``
(docs/fault_tolerance.md, "The repeated-fault drill", has the figures). Faults stop after ``--minutes`` or at the
last step, whichever comes first.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

LAYOUT = ["cluster.devices=2", "cluster.num_nodes=2", "parallel.dp_replicate=2", "data.micro_batch_size=1"]
GROUP, SIZE = 2, 4


def _overrides(steps: int, ckpt_every: int) -> list[str]:
    from parity import PARITY

    base = [o for o in PARITY if not o.startswith("trainer.max_steps=")]
    return [
        *base,
        *LAYOUT,
        f"trainer.max_steps={steps}",
        f"optim.total_steps={steps}",
        "data.max_bytes=3000000",  # enough tokens that the steps do not wrap an epoch
        f"checkpoint.every_n_steps={ckpt_every}",
        "cluster.timeout_s=60",
    ]


def _rank(run: Path, rank: int, port: int, overrides: list[str], dump: Path, attempt: int) -> None:
    """One rank: the train command in-process, with the final step's parity dump and a step clock (job rank 0)."""
    fd = os.open(run / f"rank-{rank}-a{attempt}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(SIZE),
        RANK=str(rank),
        LOCAL_RANK=str(rank % GROUP),
        NODE_RANK=str(rank // GROUP),
        LOCAL_WORLD_SIZE=str(GROUP),
    )
    if "fault_tolerance.enabled=true" not in overrides:  # as torchrun's workers: the launcher's store, as a client
        os.environ.update(
            TORCHELASTIC_RUN_ID="ft_drill", TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt)
        )
    import lightning.pytorch as L

    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.run import train
    from lit_titan.strategies.strategy import TitanStrategy
    from parity import ParityDump

    clock = run / "steps.csv"

    class StepClock(L.Callback):
        """Job rank 0 appends ``step,time`` after every optimizer step (the drill's timeline); not after a
        micro-batch that only accumulates (the step counter did not move)."""

        def on_train_start(self, trainer, pl_module) -> None:
            self.last = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if rank == 0 and trainer.global_step != self.last:
                self.last = trainer.global_step
                with clock.open("a") as f:
                    f.write(f"{trainer.global_step},{time.time():.4f}\n")

    load = TitanStrategy.load_checkpoint

    def timed_load(self, *args, **kwargs):  # the restart path's reload time, one line in this rank's log
        start = time.monotonic()
        out = load(self, *args, **kwargs)
        print(f"ft_drill: reload {time.monotonic() - start:.3f} s", flush=True)
        return out

    TitanStrategy.load_checkpoint = timed_load
    steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("trainer.max_steps="))
    run_app(overrides, partial(train, callbacks=[ParityDump(dump, [steps - 1]), StepClock()]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of gloo state shared with a dead peer (lit_titan.job.ranks.exit_rank)


def _store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _steps_done(run: Path) -> int:
    path = run / "steps.csv"
    if not path.exists():
        return 0
    lines = path.read_text().split()
    return int(lines[-1].split(",")[0]) if lines else 0


def _joined(run: Path) -> int:
    path = run / "membership.csv"
    return sum(r["event"] == "joined" for r in csv.DictReader(path.open())) if path.exists() else 0


def _start(ctx, run: Path, ranks: range, port: int, overrides: list[str], attempt: int) -> list:
    procs = []
    for rank in ranks:
        dump = run / "dump" if rank < GROUP else run / f"dump-replica1-a{attempt}"
        p = ctx.Process(target=_rank, args=(run, rank, port, [*overrides, f"run_dir={run}"], dump, attempt))
        p.start()
        procs.append(p)
    return procs


def drill(mode: str, run: Path, args: argparse.Namespace) -> dict:
    """Train ``args.steps`` steps under ``mode`` (reference: no faults); the timeline and the faults fired."""
    run.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(args.seed)
    overrides = _overrides(args.steps, args.ckpt_every)
    if mode.startswith("replica"):
        overrides += ["fault_tolerance.enabled=true", "fault_tolerance.dead_after_s=1"]
    if mode == "restart":
        overrides += ["resume=auto"]
    store = _store()
    procs = _start(ctx, run, range(SIZE), store.port, overrides, 0)
    faults: list[dict] = []
    first_step_at = None
    attempt = 0
    watched = procs[:GROUP] if mode.startswith("replica") else procs  # replica: the run ends when group 0 does
    lines_at_restart = 0
    while any(p.is_alive() for p in watched):
        time.sleep(0.1)
        done = _steps_done(run)
        if first_step_at is None and done:
            first_step_at = time.time()
        if (
            mode not in ("restart", "replica")
            or first_step_at is None
            or time.time() - first_step_at > args.minutes * 60
        ):
            continue
        if time.time() - (faults[-1]["at"] if faults else first_step_at) < args.kill_every:
            continue
        if mode == "restart":
            lines = len((run / "steps.csv").read_text().split())
            if lines <= lines_at_restart:
                continue  # not recovered yet: a step after the resume first
            victim = rng.randrange(SIZE)
            os.kill(procs[victim].pid, signal.SIGKILL)
            faults.append({"at": time.time(), "step": done, "killed": [victim]})
            for p in procs:  # torchrun's agent ends the other workers and starts all again
                p.kill()
            for p in procs:
                p.join()
            lines_at_restart = len((run / "steps.csv").read_text().split())
            attempt += 1
            procs = watched = _start(ctx, run, range(SIZE), store.port, overrides, attempt)
        else:
            if _joined(run) < len(faults):
                continue  # the last killed group has not rejoined yet
            for p in procs[GROUP:]:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs[GROUP:]:
                p.join()
            faults.append({"at": time.time(), "step": done, "killed": list(range(GROUP, SIZE))})
            attempt += 1
            procs[GROUP:] = _start(ctx, run, range(GROUP, SIZE), store.port, overrides, attempt)
    for p in procs:  # replica: a restarted group still waiting to be admitted when group 0 finished
        p.join(timeout=5 if mode.startswith("replica") else 300)
        if p.exitcode is None:
            p.kill()
    rows = [line.split(",") for line in (run / "steps.csv").read_text().split()]
    start = float(rows[0][1])
    return {
        "mode": mode,
        "faults": faults,
        "first_step_end": start,
        "last_step_end": float(rows[-1][1]),
        "timeline": [(int(s), float(t)) for s, t in rows],
        "codes": [p.exitcode for p in procs],
    }


def step_time(result: dict, steps: int) -> float:
    """The fault-free step time: the uninterrupted run's wall time per step (its checkpoint saves included)."""
    times = [t for _, t in result["timeline"]]
    return (times[-1] - times[0]) / (steps - 1)


def summarise(result: dict, ref_step: float, ref_dir: Path, run: Path, steps: int) -> dict:
    from parity import TOL, compare, load_dumps

    wall = result["last_step_end"] - result["first_step_end"] + ref_step  # + the first step's own time
    final = steps - 1
    report = compare(ref_dir / "dump", run / "dump", [final])
    mine, ref = load_dumps(run / "dump")[final], load_dumps(ref_dir / "dump")[final]
    bitwise = all(mine["params"][n].equal(t) for n, t in ref["params"].items())
    out = {
        "mode": result["mode"],
        "faults": len(result["faults"]),
        "wall_s": round(wall, 1),
        "effective": round(steps * ref_step / wall, 3),
        "final_weights_bitwise": bitwise,
        "worst_rel_error": {k: f"{v[0]:.1e}" for k, v in report.worst.items()},
        "within_parity_tol": report.margin(TOL)[0] <= 1,
    }
    if result["mode"] == "restart":
        reloads = [
            float(line.split()[2])
            for log in sorted(run.glob("rank-0-a*.log"))
            for line in log.read_text().splitlines()
            if line.startswith("ft_drill: reload ")
        ]
        timeline = result["timeline"]
        resumed, recover = [], []  # per fault: the step resumed from; fault -> the first step after the resume
        for f in result["faults"]:
            after = [(s, t) for s, t in timeline if t > f["at"]]
            if after:
                resumed.append(after[0][0] - 1)
                recover.append(after[0][1] - f["at"])
        steps_lost = sum(f["step"] - r for f, r in zip(result["faults"], resumed))
        out.update(
            steps_trained_again=steps_lost,
            reload_s=[round(r, 3) for r in reloads],
            fault_to_first_step_s=[round(r, 1) for r in recover],
        )
    if result["mode"] == "replica":
        rows = list(csv.DictReader((run / "membership.csv").open())) if (run / "membership.csv").exists() else []
        left = [r for r in rows if r["event"] == "left"]
        joined = [r for r in rows if r["event"] == "joined"]
        out.update(
            detect_s=[float(r["detect_s"]) for r in left],
            membership_s=[float(r["agree_s"]) for r in left],
            regroup_s=[float(r["rebuild_s"]) for r in left],
            rejoin_transfer_s=[float(r["transfer_s"]) for r in joined],
        )
        rejoined = [d for d in sorted(run.glob("dump-replica1-a*")) if final in load_dumps(d)]
        if rejoined:  # the group that rejoined last and trained to the end: group 0's weights, bitwise
            theirs = load_dumps(rejoined[-1])[final]["params"]
            out["rejoined_group_bitwise"] = all(theirs[n].equal(t) for n, t in mine["params"].items())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["restart", "replica", "all"], default="all")
    parser.add_argument("--minutes", type=float, default=3.0, help="fire faults for this long (M)")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between faults (K)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="checkpoint.every_n_steps (C)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/ft_drill"))
    args = parser.parse_args(argv)

    # Imported once, for every forked rank.
    import lightning.pytorch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import lit_titan.cli.hydra_app  # noqa: F401
    import lit_titan.job.run  # noqa: F401
    import lit_titan.train  # noqa: F401
    from helpers import _JOB_ENV_DROP

    for key in _JOB_ENV_DROP:
        os.environ.pop(key, None)
    ref = drill("reference", args.out / "reference", args)
    ref_step = step_time(ref, args.steps)
    rows: list[dict] = [{"mode": "reference", "step_s": round(ref_step, 4)}]
    for mode in ["restart", "replica"] if args.mode == "all" else [args.mode]:
        baseline = ref_step
        if mode == "replica":  # its own fault-free step time: the step runs another way (ReplicaStep.run)
            baseline = step_time(drill("replica-reference", args.out / "replica-reference", args), args.steps)
            rows.append({"mode": "replica-reference", "step_s": round(baseline, 4)})
        result = drill(mode, args.out / mode, args)
        (args.out / mode / "drill.json").write_text(json.dumps(result))  # the faults and the timeline
        rows.append(summarise(result, baseline, args.out / "reference", args.out / mode, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    settings = {k: getattr(args, k) for k in ("minutes", "kill_every", "ckpt_every", "steps", "seed")}
    (args.out / "summary.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    print(json.dumps({"settings": settings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
