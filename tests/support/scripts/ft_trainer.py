"""The real trainer with ``fault_tolerance.enabled=true``: one forked process per rank, the store in this one.

Run by tests/unit/fault_tolerance/test_ft_trainer.py. ``ft_trainer.py RUN_DIR KILL_STEP RESTART [--module NAME] [--mutant NAME]
OVERRIDE...``: hosts the
job's TCPStore (as a torchrun agent would: it must outlive the replica groups), forks one rank per process of
the job, each running the train command in-process with the parity dump
(``parity.train_case``), as Lightning's LightningEnvironment sees an externally launched rank; each replica group is a "node"
(``cluster.devices`` = one group's processes, ``cluster.num_nodes`` = ``parallel.dp_replicate``), as when every
group is its own launch. Every rank of
replica group 1 gets ``fault.kill_rank=<its rank in the group> fault.at_step=KILL_STEP``, so the whole group
SIGKILLs itself after step KILL_STEP - 1. Replica group 0 dumps to RUN_DIR/dump, group 1 to RUN_DIR/dump-replica1;
each rank's output in RUN_DIR/rank-N.log; exit codes by rank in RUN_DIR/codes.json. RESTART=1: once group 1
died, start its ranks again (their exit codes follow; their dump in RUN_DIR/dump-rejoined), holding group 0 at
step KILL_STEP + 1 until they wait to be admitted. KILL_STEP 0: no fault. ``--mutant NAME``: then one fault-free
step of the same job with that planted bug (tests/support/mutants/), in RUN_DIR/mutant. The job's rank 0 writes its
throughput callback's last figures to RUN_DIR/throughput.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from helpers import _JOB_ENV_DROP


def _callbacks(dump: Path, record: Path | None) -> list:
    import lightning as L

    from lit_titan.callbacks.throughput import ThroughputMonitor
    from parity import DUMP_STEPS, ParityDump

    class ThroughputRecord(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            monitor = next(c for c in trainer.callbacks if isinstance(c, ThroughputMonitor))
            record.write_text(json.dumps(monitor.last))

    return [ParityDump(dump, DUMP_STEPS), *([ThroughputRecord()] if record else [])]


# ``--module NAME``: a subclass in tests/support/user_modules.py trains instead of PretrainModule (set before the
# ranks are forked, so each inherits it)
_USER_MODULE: str | None = None


def _rank(
    run_dir: Path,
    rank: int,
    size: int,
    group: int,
    port: int,
    overrides: list[str],
    dump: Path,
    log: str = "",
    mutant: str | None = None,
) -> None:
    record = run_dir / "throughput.json" if rank == 0 and not log else None  # the job's rank 0, first start
    fd = os.open(run_dir / (log or f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % group),
        NODE_RANK=str(rank // group),
        LOCAL_WORLD_SIZE=str(group),
    )
    from functools import partial

    from lit_titan.cli.hydra_app import run_app
    from lit_titan.job.run import train
    from mutants import applied

    print(f"$ python -m lit_titan.train {' '.join(overrides)}  # parity dump, mutant={mutant}", flush=True)
    if _USER_MODULE:  # a user's subclass as the job's module (parity.train_user_case does the same)
        import lit_titan.module
        import user_modules

        lit_titan.module.PretrainModule = getattr(user_modules, _USER_MODULE)
    with applied(mutant):
        run_app(overrides, partial(train, callbacks=_callbacks(dump, record)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of gloo state shared with the dead group (lit_titan.job.ranks.exit_rank)


def main(argv: list[str]) -> None:
    # Imported once, for every rank (forked): each would otherwise pay them under the machine's load.
    import lightning.pytorch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import lit_titan.cli.hydra_app  # noqa: F401
    import lit_titan.fault_tolerance.lightning_step  # noqa: F401
    import lit_titan.job.run  # noqa: F401
    import lit_titan.module  # noqa: F401
    import lit_titan.strategies.strategy  # noqa: F401
    import lit_titan.train  # noqa: F401
    import parity  # noqa: F401

    global _USER_MODULE
    run_dir, kill_step, restart, overrides = Path(argv[0]), int(argv[1]), argv[2] == "1", argv[3:]
    mutant = None
    if overrides[:1] == ["--module"]:
        _USER_MODULE, overrides = overrides[1], overrides[2:]
    if overrides[:1] == ["--mutant"]:
        mutant, overrides = overrides[1], overrides[2:]
    for key in _JOB_ENV_DROP:
        os.environ.pop(key, None)
    _job(run_dir, kill_step, restart, overrides)
    if mutant:  # one fault-free step with the planted bug, in this launcher (its imports are paid already)
        one_step = [o for o in overrides if not o.startswith("trainer.max_steps=")] + ["trainer.max_steps=1"]
        _job(run_dir / "mutant", 0, False, one_step, mutant)


def _job(run_dir: Path, kill_step: int, restart: bool, overrides: list[str], mutant: str | None = None) -> None:
    import multiprocessing

    import torch.distributed as dist

    run_dir.mkdir(parents=True, exist_ok=True)
    group = next(int(o.split("=")[1]) for o in overrides if o.startswith("cluster.devices="))
    size = group * next(int(o.split("=")[1]) for o in overrides if o.startswith("cluster.num_nodes="))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    procs = []
    for rank in range(size):
        extra = [f"run_dir={run_dir}"]
        dump = run_dir / "dump"
        if rank // group == 1:
            if kill_step:
                extra += [f"fault.kill_rank={rank % group}", f"fault.at_step={kill_step}"]
            dump = run_dir / "dump-replica1"
        elif rank == 0 and restart:
            extra += ["fault.kill_rank=0", f"fault.at_step={kill_step + 1}", "fault.pause=true"]
        args = (run_dir, rank, size, group, store.port, [*overrides, *extra], dump)
        procs.append(ctx.Process(target=_rank, args=args, kwargs={"mutant": mutant}))
        procs[-1].start()
    if restart:  # start replica group 1 again once it died, as a launcher would (logs: rank-N-restarted.log)
        for proc in procs[group : 2 * group]:
            proc.join(timeout=300)
        for rank in range(group, 2 * group):
            args = (
                run_dir,
                rank,
                size,
                group,
                store.port,
                [*overrides, f"run_dir={run_dir}"],
                run_dir / "dump-rejoined",
            )
            procs.append(ctx.Process(target=_rank, args=args, kwargs={"log": f"rank-{rank}-restarted.log"}))
            procs[-1].start()
        # Group 0's first rank waits at step KILL_STEP + 1 (fault.pause) until the restarted ranks wait to be
        # admitted: however loaded the machine, they rejoin before the run ends.
        # The signal goes once both have happened: the restarted ranks may reach their join before rank 0 reaches
        # its pause (an idle machine), and a SIGCONT sent before the pause is lost (its handler is not yet set).
        deadline = time.monotonic() + 240
        paused = run_dir / "rank-0.log"
        while time.monotonic() < deadline and (
            store.add("lit_titan/ft/join/1", 0) < group
            or not (paused.is_file() and "paused at step" in paused.read_text(errors="replace"))
        ):
            time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGCONT)
    for proc in procs:
        proc.join(timeout=300)
        if proc.exitcode is None:
            proc.kill()
    (run_dir / "codes.json").write_text(json.dumps([p.exitcode for p in procs]))


if __name__ == "__main__":
    main(sys.argv[1:])
