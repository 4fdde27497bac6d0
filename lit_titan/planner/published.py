"""The step-time model against TorchTitan's published H100 results: calibrate on 8B, predict 70B and 405B.

Source: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (end of 2024; Grand Teton
hosts: 8 x H100 with 96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU). Two rows of its Table 1
(Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, seq 8192, selective AC) fit the two compute parameters:
"FSDP + torch.compile" (6,667 TPS/GPU) the compute efficiency, then "+ Float8" (8,532) the block
Linears' Float8 speed-up. Communication efficiency and bandwidths stay at the profile's values. The
70B (Table 4) and 405B (Table 5) rows are then predicted without refitting.
``docs/benchmarks.md`` holds the table :func:`markdown_table` renders; tests/unit/planner/test_plan.py pins it.
"""

from __future__ import annotations

from typing import Any

from lit_titan.planner.estimate import DEFAULT_EFFICIENCIES, Efficiencies

SOURCE = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
# The benchmark's hosts, not our h100_* profiles' 80 GB SXM parts.
GRAND_TETON = ["cluster.hbm_gib=96", "cluster.hbm_gbps=2400"]
_8B = [
    "model=llama3_8b",
    "cluster=h100_8",
    *GRAND_TETON,
    "data.seq_len=8192",
    "data.global_batch_size=16",
    "data.micro_batch_size=2",
    "callbacks.activation_checkpointing.mode=selective_op",
]

# (name, settings in words, overrides, published TPS/GPU, published memory GiB, role)
ROWS: list[tuple[str, str, list[str], float, float, str]] = [
    (
        "8B, 8 GPUs, Table 1",
        "FSDP 8, compile, bf16, local batch 2, seq 8192, selective AC",
        [*_8B, "callbacks=[throughput,activation_checkpointing,compile]"],
        6667,
        77.0,
        "fit: compute",
    ),
    (
        "8B, 8 GPUs, Table 1",
        "FSDP 8, compile + Float8, local batch 2, seq 8192, selective AC",
        [*_8B, "callbacks=[throughput,activation_checkpointing,compile,float8]"],
        8532,
        76.8,
        "fit: Float8",
    ),
    (
        "70B, 256 GPUs, Table 4",
        "FSDP 32 x TP 8, compile + Float8, local batch 16, full AC (no async TP)",
        ["+recipe=llama3_70b_h100_256", *GRAND_TETON],
        829,
        71.9,
        "predicted",
    ),
    (
        "405B, 512 GPUs, Table 5",
        "FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32, full AC, compile + Float8 + async TP",
        ["+recipe=llama3_405b_h100_512", *GRAND_TETON, "parallel.pp_schedule=1F1B", "parallel.pp_stages_per_rank=1"],
        100,
        82.5,
        "predicted",
    ),
    (
        "405B, 512 GPUs, Table 5",
        "FSDP 8 x TP 8 x PP 8, Interleaved 1F1B, local batch 32, full AC, compile + Float8 + async TP",
        ["+recipe=llama3_405b_h100_512", *GRAND_TETON],
        128,
        72.7,
        "predicted",
    ),
]


def _predict(overrides: list[str], eff: Efficiencies) -> dict[str, Any]:
    from lit_titan.config import compose
    from lit_titan.planner.calibrate import predict

    return predict(compose(overrides), eff)


def _bisect(
    overrides: list[str], target_tps: float, eff: Efficiencies, field: str, lo: float, hi: float
) -> Efficiencies:
    """The value of ``field`` in [lo, hi] at which the predicted tokens/s per GPU equals ``target_tps``
    (predicted throughput rises monotonically with each efficiency); log-scale bisection."""
    from lit_titan.config import compose
    from lit_titan.planner.calibrate import predict

    cfg = compose(overrides)
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        tps = predict(cfg, eff.with_(**{field: mid}))["tokens_per_sec_per_device"]
        lo, hi = (mid, hi) if tps < target_tps else (lo, mid)
    return eff.with_(**{field: (lo * hi) ** 0.5})


def calibrate_8b() -> Efficiencies:
    eff = _bisect(ROWS[0][2], ROWS[0][3], DEFAULT_EFFICIENCIES, "compute", 1e-3, 1.0)
    eff = _bisect(ROWS[1][2], ROWS[1][3], eff, "float8_linear_speedup", 1.0, 4.0)
    return eff.with_(source="TorchTitan H100 Table 1 (8B, compile; compile + Float8), lit_titan/planner/published.py")


def comparison() -> tuple[Efficiencies, list[dict[str, Any]]]:
    """Calibrated efficiencies and, per published row, the prediction beside the figure."""
    from lit_titan.config import compose
    from lit_titan.planner.calibrate import predict_memory

    eff = calibrate_8b()
    out = []
    for name, settings, ov, tps, mem, role in ROWS:
        p = _predict(ov, eff)
        est_mem = predict_memory(compose(ov)) / 1024**3
        out.append(
            {
                "row": name,
                "settings": settings,
                "published_tps": tps,
                "predicted_tps": p["tokens_per_sec_per_device"],
                "error": p["tokens_per_sec_per_device"] / tps - 1,
                "published_mem_gib": mem,
                "predicted_mem_gib": est_mem,
                "role": role,
                "bubble": p["pp_bubble_fraction"],
                "mfu": p["mfu_bound"],
            }
        )
    return eff, out


def markdown_table() -> str:
    eff, rows = comparison()
    lines = [
        f"Calibrated on the two 8B rows: compute efficiency {eff.compute:.3f} of 989 TFLOP/s, "
        f"Float8 speed-up of the block Linears {eff.float8_linear_speedup:.2f}x; comm efficiency "
        f"{eff.comm:g} (default, not fitted).",
        "",
        "| Published row | Settings | Role | TPS/GPU published | TPS/GPU predicted | error | "
        "memory published (GiB, reserved) | memory estimated (GiB, tensors) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['settings']} | {r['role']} | {r['published_tps']:,.0f} | "
            f"{r['predicted_tps']:,.0f} | {r['error']:+.0%} | {r['published_mem_gib']:.1f} | "
            f"{r['predicted_mem_gib']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
