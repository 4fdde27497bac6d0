"""Two runs' dumps (``dump.py``) compared: the worst error of each kind, and per parameter.

Errors are relative to the reference's scale: max |got - ref| / max |ref| per tensor, so a parameter whose
gradient is tiny everywhere is not judged by its own round-off. The gradient *ratio* (norm of got over
norm of ref) is what a user reads first: 2.0 or 0.5 is a reduction counted twice or missed, 1/N a mean
taken over N ranks where a sum was due.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ParameterRow", "Report", "Tolerance", "compare", "load_dumps", "norms", "parameter_rows"]


@dataclass(frozen=True)
class Tolerance:
    """Largest allowed error of each kind (each measured against a noise floor)."""

    grads: float  # per parameter: max |got - ref| / max |ref|, every dumped step
    norm: float  # relative error of the global grad norm (clipping's)
    params: float  # per parameter, weights after each dumped step
    loss: float = 1e-5  # relative error of each step's logged loss


@dataclass
class Report:
    """Worst error per kind, with where it was (step, parameter)."""

    worst: dict[str, tuple[float, str]] = field(default_factory=dict)

    def add(self, kind: str, err: float, where: str) -> None:
        if kind not in self.worst or not (err <= self.worst[kind][0]):  # NaN counts as worst
            self.worst[kind] = (err, where)

    def margin(self, tol: Tolerance) -> tuple[float, str]:
        """The largest error / tolerance over the kinds, and what it was (>1: parity fails)."""
        best = (0.0, "")
        for kind, (err, where) in self.worst.items():
            ratio = math.inf if math.isnan(err) else err / getattr(tol, kind)
            if ratio > best[0]:
                best = (ratio, f"{kind} {where}: {err:.3g} (tolerance {getattr(tol, kind):.1g})")
        return best

    def summary(self) -> str:
        return ", ".join(f"{k} {e:.3g} at {w}" for k, (e, w) in sorted(self.worst.items()))


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
        return math.nan
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return (got.double() - ref.double()).abs().max().item() / (scale if scale > 0 else 1.0) if ref.numel() else 0.0


def load_dumps(run_dir: Path | str) -> dict[int, dict[str, Any]]:
    return {
        int(p.stem.split("-")[1]): torch.load(p, weights_only=True) for p in sorted(Path(run_dir).glob("step-*.pt"))
    }


def compare(ref_dir: Path | str, got_dir: Path | str, steps: list[int] | None = None) -> Report:
    """Per-parameter max relative error of gradients and weights, and the norm's, at every dumped step."""
    ref, got = load_dumps(ref_dir), load_dumps(got_dir)
    if steps is not None:
        ref = {s: d for s, d in ref.items() if s in steps}
    if not ref or sorted(ref) != sorted(got):
        raise ValueError(f"dumped steps differ: reference {sorted(ref)}, got {sorted(got)}")
    report = Report()
    for step in sorted(ref):
        r, g = ref[step], got[step]
        for kind in ("grads", "params"):
            missing = sorted(set(r[kind]) ^ set(g[kind]))
            if missing:
                report.add(kind, math.nan, f"step {step}: parameters only in one run: {missing[:4]}")
                continue
            for name, ref_t in r[kind].items():
                report.add(kind, relative_error(g[kind][name], ref_t), f"step {step} {name}")
        report.add("norm", abs(g["norm"] - r["norm"]) / r["norm"], f"step {step}")
    return report


def norms(run_dir: Path | str) -> dict[int, float]:
    return {step: d["norm"] for step, d in load_dumps(run_dir).items()}


@dataclass(frozen=True)
class ParameterRow:
    """One parameter over every dumped step: the gradient ratio farthest from 1, the worst errors."""

    name: str
    grad_ratio: float  # |grad got| / |grad ref|
    grad_error: float
    param_error: float
    step: int  # where the worse of the two errors was

    def score(self, tol: Tolerance) -> float:
        errs = (self.grad_error / tol.grads, self.param_error / tol.params)
        return math.inf if any(math.isnan(e) for e in errs) else max(errs)


def parameter_rows(ref_dir: Path | str, got_dir: Path | str) -> list[ParameterRow]:
    """Every parameter (and persistent buffer, with no gradient) of the reference, in its order."""
    ref, got = load_dumps(ref_dir), load_dumps(got_dir)
    rows: dict[str, dict[str, Any]] = {}
    for step in sorted(ref):
        r, g = ref[step], got.get(step, {"grads": {}, "params": {}})
        for name in r["params"]:
            row = rows.setdefault(name, {"ratio": math.nan, "grad": 0.0, "param": 0.0, "step": step, "worst": -1.0})
            ref_g, got_g = r["grads"].get(name), g["grads"].get(name)
            if ref_g is not None:
                grad_err = relative_error(got_g, ref_g) if got_g is not None else math.nan
                ref_norm = ref_g.double().norm().item()
                ratio = got_g.double().norm().item() / ref_norm if got_g is not None and ref_norm > 0 else math.nan
                if math.isnan(row["ratio"]) or abs(math.log(ratio or 1e-300)) > abs(math.log(row["ratio"] or 1e-300)):
                    row["ratio"] = ratio
                row["grad"] = _worse(row["grad"], grad_err)
            got_p = g["params"].get(name)
            param_err = relative_error(got_p, r["params"][name]) if got_p is not None else math.nan
            row["param"] = _worse(row["param"], param_err)
            worst = max(grad_err if ref_g is not None else 0.0, param_err)
            if math.isnan(worst) or worst > row["worst"]:
                row["worst"], row["step"] = (math.inf if math.isnan(worst) else worst), step
    return [ParameterRow(n, v["ratio"], v["grad"], v["param"], v["step"]) for n, v in rows.items()]


def _worse(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
