"""One rank of an HSDP job (dp_replicate x dp_shard) with replica-group fault tolerance, in plain PyTorch.

Run by tests/unit/fault_tolerance/test_replica_loss.py: ``main`` runs jobs one after the other, each with a
TCPStore hosted by this process (as a torchrun agent would) and one forked process per rank. Each replica group
is its own gloo world (FSDP over its shard ranks); only ``lit_titan.fault_tolerance`` spans the replicas. The
ranks of replica ``KILL_REPLICA`` SIGKILL themselves at ``KILL_STEP``, after their backward and before the
cross-replica sum: the survivors must train that step's and every later step's global batch alone. ``reference()`` is the same training on one process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, max_seq_len=64)
SEQ, GLOBAL_BATCH, MICRO, LR, CLIP, SEED = 32, 8, 2, 1e-2, 0.5, 0
STEPS, KILL_STEP, KILL_REPLICA = 12, 5, 1


def build():
    from lit_titan.models.registry import build_model, model_args

    model = build_model(model_args("llama3_debug", **MODEL))
    model.init_weights(seed=SEED)
    return model


def batch(step: int) -> torch.Tensor:
    """The step's global batch, [GLOBAL_BATCH, SEQ + 1] tokens: a noisy repeating pattern (learnable)."""
    g = torch.Generator().manual_seed(1000 + step)
    base = torch.arange(SEQ + 1).repeat(GLOBAL_BATCH, 1) * 7 % MODEL["vocab_size"]
    noise = torch.randint(0, MODEL["vocab_size"], base.shape, generator=g)
    keep = torch.rand(base.shape, generator=g) < 0.7
    return torch.where(keep, base, noise)


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def clip_and_step(model, opt) -> float:
    from lit_titan.strategies.grad_norm import clip_grads_with_norm_, total_grad_norm

    params = list(model.parameters())
    norm = total_grad_norm(params)
    clip_grads_with_norm_(params, CLIP, norm)
    opt.step()
    opt.zero_grad()
    return float(norm)


def reference(steps: int) -> dict:
    """One process, the whole global batch in one forward: losses, pre-clip norms, final weights.

    On one thread: intra-op threads spin against the forked ranks on a loaded machine (41 s instead of 0.8 s).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(steps)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int) -> dict:
    torch.manual_seed(SEED)
    model = build()
    opt = optimizer(model)
    losses, norms = [], []
    for step in range(steps):
        tokens = batch(step)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(clip_and_step(model, opt))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def worker(
    out: str, replica: int, replicas: int, shard: int, shards: int, port: int, mutant: str | None, rejoin: bool
) -> None:
    """One rank: FSDP over its replica's shard ranks, ``ReplicaGroups`` across replicas; output in ``out``.

    ``rejoin``: the rank of a group restarted after it died, which joins the live ones at a later step.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_titan.fault_tolerance import ReplicaGroups, ReplicaLost
    from lit_titan.models.llama3.parallelize import fsdp_units
    from lit_titan.strategies.fsdp import FSDPConfig, apply_fsdp
    from mutants import applied

    name = f"rank-{replica * shards + shard}{'-rejoined' if rejoin else ''}.log"
    log = os.open(Path(out) / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    prefix = f"replica{replica}{'/rejoined' if rejoin else ''}/"
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=shard, world_size=shards)
    mesh = init_device_mesh("cpu", (shards,), mesh_dim_names=("dp_shard",))
    model = build()
    apply_fsdp(fsdp_units(model), model, mesh, "32-true", FSDPConfig())
    opt = optimizer(model)
    params = list(model.parameters())
    ft = ReplicaGroups(
        ("127.0.0.1", port), replica, replicas, shard, shards, mesh.get_group(), GLOBAL_BATCH,
        run_dir=out, timeout_s=30.0, dead_after_s=1.0, heartbeat_s=0.1, params=params, optimizer=opt, rejoin=rejoin,
    )  # fmt: skip

    def train(tokens: torch.Tensor, samples: list[int]) -> torch.Tensor:
        """Forward/backward over ``samples`` in micro-batches: gradients of the sum of per-sequence losses."""
        total = torch.zeros(())
        for i in range(0, len(samples), MICRO):
            x = tokens[samples[i : i + MICRO]]
            loss = model(x[:, :-1], labels=x[:, 1:]) * len(x)
            loss.backward()
            total += loss.detach()
        return total

    losses, norms = [], []
    with applied(mutant):
        first = ft.join() if rejoin else 0
        for step in range(first, STEPS):
            tokens = batch(step)
            loss_sum = train(tokens, ft.begin_step(step))
            if step == KILL_STEP and replica == KILL_REPLICA and not rejoin:
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                try:
                    loss = ft.reduce([q.grad for q in params], loss_sum)
                    break
                except ReplicaLost:
                    loss_sum = loss_sum + train(tokens, ft.recover())
            losses.append(float(loss))
            norms.append(clip_and_step(model, opt))
        full = {n: q.full_tensor().detach() for n, q in model.named_parameters()}
    if shard == 0:
        torch.save(full, Path(out) / f"params-replica{replica}.pt")
        curve = {"losses": losses, "norms": norms, "members": ft.members, "first_step": first}
        (Path(out) / f"curve-replica{replica}.json").write_text(json.dumps(curve))
    ft.close()
    # The process ends in multiprocessing's os._exit: no gloo teardown (see lit_titan.job.ranks.exit_rank).


def run_job(out: Path, replicas: int, shards: int, mutant: str | None = None, rejoin: bool = False) -> list[int | None]:
    """Host the job's store (as a torchrun agent would) and fork its ranks; their exit codes by global rank.

    Forked, not spawned: torch is imported once for every rank (each fresh interpreter costs seconds).
    ``rejoin``: once the killed group's ranks are gone, start them again (as a launcher would); their exit
    codes follow the others'.
    """
    import multiprocessing

    import torch._dynamo  # noqa: F401  (what FSDP's first use and the model's init import: once, for every rank)
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

    import lit_titan.fault_tolerance  # noqa: F401
    import lit_titan.models.llama3.parallelize  # noqa: F401
    import lit_titan.models.registry  # noqa: F401
    import lit_titan.strategies.fsdp  # noqa: F401
    import mutants  # noqa: F401

    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=worker, args=(str(out), r, replicas, s, shards, store.port, mutant, False))
        for r in range(replicas)
        for s in range(shards)
    ]
    for proc in procs:
        proc.start()
    if rejoin:
        killed = procs[KILL_REPLICA * shards : (KILL_REPLICA + 1) * shards]
        for proc in killed:
            proc.join(timeout=240)
        for s in range(shards):
            args = (str(out), KILL_REPLICA, replicas, s, shards, store.port, mutant, True)
            procs.append(ctx.Process(target=worker, args=args))
            procs[-1].start()
    for proc in procs:
        proc.join(timeout=240)
        if proc.exitcode is None:
            proc.kill()
    return [proc.exitcode for proc in procs]


def main(argv: list[str] | None = None) -> None:
    """``replica_loss.py OUT NAME:REPLICAS:SHARDS:REJOIN[:MUTANT] ...``: each job in OUT/NAME; OUT/codes.json."""
    argv = sys.argv[1:] if argv is None else argv
    out, codes = Path(argv[0]), {}
    for job in argv[1:]:
        name, replicas, shards, rejoin, *mutant = job.split(":")
        codes[name] = run_job(out / name, int(replicas), int(shards), mutant[0] if mutant else None, rejoin == "1")
    (out / "codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    main()
