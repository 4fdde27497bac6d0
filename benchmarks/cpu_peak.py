"""Peak numbers of this machine for conf/cluster/cpu.yaml (the planner's CPU profile).

    python benchmarks/cpu_peak.py

fp32 matmul GFLOP/s of one thread (each gloo rank of a CPU run is one process) and the bus
bandwidth of a 2-rank gloo all-reduce over 127.0.0.1 (ring: 2*(n-1)/n x bytes per rank).
"""

import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def mm():
    torch.set_num_threads(1)
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    best = 0
    for _ in range(5):
        t = time.perf_counter()
        n = 10
        for _ in range(n):
            a @ b
        dt = time.perf_counter() - t
        best = max(best, n * 2 * 1024**3 / dt)
    print(f"matmul fp32 1 thread 1024^3: best {best / 1e9:.1f} GFLOP/s")


def w(rank):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29611", rank=rank, world_size=2)
    x = torch.ones(16 * 1024 * 1024)  # 64 MiB
    dist.all_reduce(x)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        dist.all_reduce(x)
        ts.append(time.perf_counter() - t)
    if rank == 0:
        dt = min(ts)
        nbytes = x.numel() * 4
        # ring all-reduce moves 2*(n-1)/n * bytes per rank
        print(flush=True)
        print(
            f"gloo all_reduce 64 MiB x2 ranks: {dt * 1e3:.1f} ms, bus bandwidth {nbytes * 2 * 0.5 / dt / 1e9:.2f} GB/s",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    mm()
    mp.spawn(w, nprocs=2)
