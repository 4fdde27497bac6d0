"""A check's verdict: the two sides' dumps, losses, the known norm and the replica findings, judged and printed.

The table a user reads: each step's loss and clip norm on both sides, the parameters whose error is largest
(gradient ratio, gradient and weight errors, the reductions their gradient went through), the known norm,
the replicas, the worst entry with its name, and the verdict. The whole per-parameter table goes to a file.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_titan.verify.compare import ParameterRow, Report, Tolerance, compare, norms, parameter_rows
from lit_titan.verify.dump import CHECKS_FILE, DUMP_DIR, REDUCTIONS_FILE

__all__ = ["TOLERANCES", "Verdict", "judge", "losses_of"]

# Per precision: in float64 about 10x (loss) to 4000x (weights) the worst a correct layout showed over the parity
# suite's layouts (docs/benchmarks.md, "lit-titan verify, per layout": gradients 5.1e-14, weights 2.0e-13, clip
# norm 2e-15; the loss 6.7e-12 in 3 steps and 1.2e-10 in the suite's 8, a pipeline summing MoE auxiliary-loss
# shares over its stages); in fp32 the suite's tolerances.
# ``known_norm`` bounds sqrt(count)'s own round-off.
TOLERANCES: dict[str, tuple[Tolerance, float]] = {
    "64-true": (Tolerance(grads=1e-10, norm=1e-11, params=1e-9, loss=1e-9), 1e-10),
    "32-true": (Tolerance(grads=8e-5, norm=3e-6, params=6e-4, loss=1e-6), 1e-5),
}


@dataclass
class Verdict:
    """Everything ``lit-titan verify`` found; ``passed`` is its exit code's meaning."""

    layout: str
    precision: str
    tolerance: Tolerance
    report: Report
    rows: list[ParameterRow]
    losses: list[tuple[float, float]]  # (reference, layout) per step
    norms: list[tuple[float, float]]
    clip: float | None
    known_norm: tuple[float, float] | None  # (expected, measured)
    known_norm_tolerance: float
    replicas: dict[str, Any] | None
    reductions: dict[str, str]
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def known_norm_error(self) -> float:
        if self.known_norm is None or None in self.known_norm:
            return math.nan
        expected, measured = self.known_norm
        return abs(measured - expected) / expected

    @property
    def margin(self) -> tuple[float, str]:
        """The worst error over the tolerance of its kind (>1 fails) and what it was."""
        ratio, what = self.report.margin(self.tolerance)
        if self.known_norm is not None:
            err = self.known_norm_error
            known = math.inf if math.isnan(err) else err / self.known_norm_tolerance
            if known > ratio:
                ratio, what = known, f"known norm: relative error {err:.3g} (tolerance {self.known_norm_tolerance:.1g})"
        return ratio, what

    @property
    def looks_like_fp32_round_off(self) -> bool:
        """A float64 check that fails only by what fp32 arithmetic leaves (1e-5 and below, no ratio off)."""
        worst = max((e for e, _ in self.report.worst.values()), default=0.0)
        ratios = [r.grad_ratio for r in self.rows if not math.isnan(r.grad_ratio)]
        return (
            self.precision == "64-true"
            and not self.passed
            and not (self.replicas or {}).get("divergent")
            and worst < 1e-5
            and all(abs(r - 1) < 1e-6 for r in ratios)
        )

    @property
    def passed(self) -> bool:
        return self.margin[0] <= 1.0 and not (self.replicas or {}).get("divergent")

    def render(self, top: int = 10) -> str:
        tol = self.tolerance
        lines = [f"lit-titan verify: {self.layout} against one process, precision {self.precision}"]
        lines += [f"  shrunk: {note}" for note in self.notes]
        lines += [
            "",
            f"{'step':>4}  {'loss: one process':>19}  {'layout':>19}  {'rel. error':>10}  "
            f"{'clip norm: one':>15}  {'layout':>15}  {'rel. error':>10}  clipped",
        ]
        for step, ((lr, lg), (nr, ng)) in enumerate(zip(self.losses, self.norms)):
            clipped = "yes" if self.clip and nr > self.clip else "no"
            lines.append(
                f"{step:>4}  {lr:>19.15g}  {lg:>19.15g}  {_rel(lg, lr):>10.2g}  {nr:>15.10g}  {ng:>15.10g}  "
                f"{_rel(ng, nr):>10.2g}  {clipped}"
            )
        worst = sorted(self.rows, key=lambda r: -r.score(tol))[:top]
        lines += [
            "",
            f"{len(worst)} parameter(s) of {len(self.rows)} with the largest errors "
            f"(tolerance: gradient {tol.grads:.0e}, weight {tol.params:.0e}):",
        ]
        lines += [_row_line(r, self.reductions) for r in worst]
        lines.append("")
        if self.known_norm is not None:
            expected, measured = self.known_norm
            lines.append(
                f"known norm: every gradient 1 -> clip norm {measured!s} against sqrt(parameters) {expected!s}: "
                f"relative error {self.known_norm_error:.2g} (tolerance {self.known_norm_tolerance:.0e})"
            )
        if self.replicas is not None:
            bad = self.replicas.get("divergent") or []
            lines.append(
                f"replicas: {self.replicas.get('checked', 0)} replicated tensors compared after every step: "
                + (f"{len(bad)} differ, first {bad[0]}" if bad else "all bitwise equal")
            )
        ratio, what = self.margin
        lines.append(f"worst: {what}: {ratio:.2g} of the tolerance" if what else "worst: nothing compared")
        if self.looks_like_fp32_round_off:
            lines.append(
                "hint: errors this small with every gradient ratio 1 are fp32 round-off, not a missed reduction: "
                "something in the model or loss computes in fp32 whatever the precision (a .float()); cast with "
                "torch.promote_types(x.dtype, torch.float32), or verify with verify.precision=32-true"
            )
        timing = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
        lines.append(f"verdict: {'PASS' if self.passed else 'FAIL'}" + (f" ({timing})" if timing else ""))
        return "\n".join(lines)

    def write(self, out: Path) -> Path:
        """The whole per-parameter table (``verify.csv``) and the printed report (``verify.txt``)."""
        with open(out / "verify.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["parameter", "grad_ratio", "grad_error", "weight_error", "step", "reductions"])
            for r in self.rows:
                w.writerow([r.name, r.grad_ratio, r.grad_error, r.param_error, r.step, self.reductions.get(r.name, "")])
        (out / "verify.txt").write_text(self.render(top=len(self.rows)) + "\n")
        return out / "verify.txt"


def _rel(got: float, ref: float) -> float:
    return abs(got - ref) / abs(ref) if ref else abs(got - ref)


def _row_line(row: ParameterRow, reductions: dict[str, str]) -> str:
    return (
        f"  {row.name:<40} grad ratio {row.grad_ratio:.9f}  grad error {row.grad_error:.2g}  "
        f"weight error {row.param_error:.2g}  (step {row.step})  {reductions.get(row.name, '')}"
    )


def losses_of(run_dir: Path) -> list[float]:
    """The logged training loss of every step, from the run's metrics.csv (always written)."""
    with open(run_dir / "metrics.csv") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def judge(
    reference: Path, layout: Path, *, what: str, precision: str, steps: int, clip: float | None, notes: list[str]
) -> Verdict:
    """The layout's run directory against the reference's, over ``steps`` steps."""
    tol, known_tol = TOLERANCES.get(precision, TOLERANCES["32-true"])
    report = compare(reference / DUMP_DIR, layout / DUMP_DIR)
    ref_losses, got_losses = losses_of(reference)[:steps], losses_of(layout)[:steps]
    for step, (r, g) in enumerate(zip(ref_losses, got_losses)):
        report.add("loss", _rel(g, r), f"step {step}")
    if len(got_losses) < len(ref_losses):
        report.add("loss", math.nan, f"the layout logged {len(got_losses)} of {len(ref_losses)} losses")
    ref_norms, got_norms = norms(reference / DUMP_DIR), norms(layout / DUMP_DIR)
    checks = json.loads((layout / CHECKS_FILE).read_text()) if (layout / CHECKS_FILE).exists() else {}
    known = checks.get("known_norm")
    reductions_file = layout / DUMP_DIR / REDUCTIONS_FILE
    return Verdict(
        layout=what,
        precision=precision,
        tolerance=tol,
        report=report,
        rows=parameter_rows(reference / DUMP_DIR, layout / DUMP_DIR),
        losses=list(zip(ref_losses, got_losses)),
        norms=[(ref_norms[s], got_norms.get(s, math.nan)) for s in sorted(ref_norms)],
        clip=clip,
        known_norm=(known["expected"], known["measured"]) if known else None,
        known_norm_tolerance=known_tol,
        replicas=checks.get("replicas"),
        reductions=json.loads(reductions_file.read_text()) if reductions_file.exists() else {},
        notes=notes,
    )
