"""Every GPU claim measured by one command that fits one ten-minute device call.

A lent GPU machine has torch and lightning but not the rest: this installs the wheels prepared on a
networked machine (``../shared/gpu-wheels.sh``) offline, then runs the checks in order of value, each
in a process group of its own under its own time limit and a shared deadline, so a slow or failing
step cannot starve the rest:

1. ``install``: the wheel folder into a private site directory (``--no-index --no-deps``);
2. ``planner``: lit-titan's predicted peak memory of each side-by-side run, and which checkpoint-stall
   job fits the free disk (CPU only);
3. ``gpu_tests``: the ``gpu``-marked tests (flex document masking backward, real FP8, CUDA timeline);
4. ``bare_bf16_compile`` / ``torchtitan_bf16_compile``: ``vs_bare_loop.py`` / ``vs_torchtitan.py`` at
   8B widths x ``--layers`` blocks, seq ``--seq-len``, bf16 + compile;
5. ``checkpoint_stall``: how long a save blocks training;
6. ``bare_float8_rowwise`` / ``torchtitan_float8_rowwise``: the same pairs with Float8 rowwise;
7. ``moe_dispatch`` and ``cp_kernels``.

After every step it rewrites ``proof.json`` and ``proof.md`` in ``--out`` (default ``$OUT``), so a
timeout or a failure keeps what ran; each step's output is in ``logs/<step>.log``.

    bash ../shared/gpu-wheels.sh                       # here, with a network: fills .whl/
    python benchmarks/gpu_proof.py --out "$OUT"        # on the GPU machine (device tool: carry .whl)
    python benchmarks/gpu_proof.py --only moe_dispatch cp_kernels --budget 200
    python benchmarks/gpu_proof.py --smoke --out /tmp/proof     # every step's code path on CPU, quickly

``--smoke`` runs the cheap benchmarks' CPU smoke modes and a dry run of the costly ones (the test
collection, each script's argument check); ``--smoke full`` runs every benchmark's own CPU smoke mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
GIB = 1024**3
GPU_TEST_FILES = (
    "tests/unit/models/test_document_masking.py",
    "tests/unit/callbacks/test_float8.py",
    "tests/unit/observe/test_observe.py",
)
# The checkpoint-stall jobs, largest first (overrides on checkpoint_stall.py's 8B-widths x 4-layer job): the
# first whose two kept checkpoints fit the free disk runs.
STALL_JOBS: dict[str, list[str]] = {
    "8b_width_4_layers": [],
    "vocab_32000": ["model.vocab_size=32000"],
    "vocab_32000_1_layer": ["model.vocab_size=32000", "model.n_layers=1"],
}
STATE_BYTES_PER_PARAM = 12  # fp32 params + AdamW's two fp32 moments (bf16-mixed)


@dataclasses.dataclass
class Step:
    """One check: how to run it (full and smoke) and which figures to read from what it wrote."""

    name: str
    limit_s: float
    command: Callable[[argparse.Namespace, Path], list[str]]
    figures: Callable[[Path, str], dict[str, Any]] = lambda path, stdout: {}
    output: str = ""  # the file under --out that the step writes (its figures' source)
    from_stdout: bool = False  # figures also read from what it printed (partial results after a timeout)


# ---- commands ------------------------------------------------------------------------------------
def _script(name: str) -> list[str]:
    return [sys.executable, str(BENCH / name)]


def planner_command(args: argparse.Namespace, out: Path) -> list[str]:
    smoke = ["--smoke"] if args.smoke else []
    return [*_script("gpu_proof.py"), "--predict", str(out / "planner.json"), *smoke, *_shape(args)]


def tests_command(args: argparse.Namespace, out: Path) -> list[str]:
    mode = ["--collect-only"] if args.smoke else ["-rfEs"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *mode, *GPU_TEST_FILES]


def _shape(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--seq-len", str(args.seq_len)]


def side_by_side_command(script: str, row: str) -> Callable[[argparse.Namespace, Path], list[str]]:
    """``vs_bare_loop.py`` / ``vs_torchtitan.py`` for one row; smoke: the argument check (or its CPU smoke)."""

    def command(args: argparse.Namespace, out: Path) -> list[str]:
        json_path = out / f"{Path(script).stem}_{row}.json"
        cmd = [*_script(script), "--only", row, "--json", str(json_path)]
        if args.smoke == "full":
            return [*cmd, "--cpu-smoke", "--steps", "1", "--warmup", "1"]
        cmd += [*_shape(args), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        return [*cmd, "--help"] if args.smoke else cmd

    return command


def stall_command(args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [*_script("checkpoint_stall.py"), "--json", str(out / "checkpoint_stall.json")]
    if args.smoke == "full":
        return [*cmd, "--cpu-smoke", "--saves", "2", "--every", "2"]
    cmd += ["--saves", "3", "--every", "5", "--run-dir", str(scratch_dir(args, "checkpoint_stall"))]
    job = STALL_JOBS[stall_job(out / "planner.json", shutil.disk_usage(args.scratch).free)]
    return [*cmd, "--help", "--", *job] if args.smoke else [*cmd, "--", *job]


def scratch_dir(args: argparse.Namespace, step: str) -> Path:
    """A step's own folder under ``--scratch``, deleted when the step ends."""
    return Path(args.scratch) / "gpu-proof-scratch" / step


def stall_job(planner_json: Path, free_bytes: int) -> str:
    """The largest checkpoint-stall job whose two kept checkpoints (plus 10% and 2 GiB) fit ``free_bytes``."""
    try:
        states = json.loads(planner_json.read_text())["predicted"]["checkpoint_state_bytes"]
    except (OSError, ValueError, KeyError):
        return list(STALL_JOBS)[-1]
    for name in STALL_JOBS:
        if name in states and 2.2 * states[name] + 2 * GIB <= free_bytes:
            return name
    return list(STALL_JOBS)[-1]


def moe_command(args: argparse.Namespace, out: Path) -> list[str]:
    smoke = ["--cpu-smoke"] if args.smoke else []
    return [*_script("moe_dispatch.py"), "--json", str(out / "moe_dispatch.json"), *smoke]


def cp_command(args: argparse.Namespace, out: Path) -> list[str]:
    shapes = [] if args.smoke else ["--seq-len", "32768", "131072", "--cp", "2", "8"]
    smoke = ["--cpu-smoke"] if args.smoke else []
    return [*_script("cp_kernels.py"), "--json", str(out / "cp_kernels.json"), *shapes, *smoke]


# ---- figures -------------------------------------------------------------------------------------
def tests_figures(path: Path, stdout: str) -> dict[str, Any]:
    """pytest's summary counts (``3 passed, 1 skipped``) and the names of the failed tests."""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", stdout)}
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", stdout)
    if collected:
        counts["collected"] = int(collected.group(1))
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", stdout, flags=re.M)
    return {**counts, **({"failures": failed} if failed else {})}


def bare_figures(path: Path, stdout: str) -> dict[str, Any]:
    """One ``vs_bare_loop.py`` row: both sides' tokens/s and peak memory, their ratio, lit-titan's MFU."""
    row = json.loads(path.read_text())[0]
    return _pair(row, "bare", "tokens_per_sec")


def torchtitan_figures(path: Path, stdout: str) -> dict[str, Any]:
    """One ``vs_torchtitan.py`` row, plus both parameter counts (the same model, checked)."""
    result = json.loads(path.read_text())
    out = _pair(result["rows"][0], "torchtitan", "tokens_per_sec")
    out["params_lit"] = result["lit_params"]
    if "params" in result["rows"][0]["torchtitan"]:
        out["params_torchtitan"] = result["rows"][0]["torchtitan"]["params"]
    return out


def _pair(row: dict, peer: str, key: str) -> dict[str, Any]:
    other, lit = row[peer], row["lit"]
    out: dict[str, Any] = {"row": row["name"]}
    a, b = other.get(key), lit.get("perf/tokens_per_sec_per_device")
    _put(out, f"{peer}_tokens_per_s", a)
    _put(out, "lit_tokens_per_s", b)
    if a and b:
        out[f"lit_over_{peer}"] = round(b / a, 3)
    _put(out, "lit_mfu", lit.get("perf/mfu"), 4)
    _put(out, f"{peer}_peak_gib", other.get("max_memory_allocated_gib"), 2)
    _put(out, "lit_peak_gib", lit.get("perf/max_memory_allocated_gib"), 2)
    for side, result in ((peer, other), ("lit", lit)):
        if "error" in result:
            out[f"{side}_error"] = result["error"]
    return out


def _put(out: dict[str, Any], key: str, value: float | None, digits: int = 1) -> None:
    if value is not None:
        out[key] = round(float(value), digits)


def stall_figures(path: Path, stdout: str) -> dict[str, Any]:
    """The first save's block and the later saves' block against one copy of the state."""
    result = json.loads(path.read_text())
    rows = result["rows"]
    later = rows[1:] or rows
    return {
        "state_gb": round(rows[0]["state_bytes"] / 1e9, 2),
        "first_blocked_s": round(rows[0]["blocked_s"], 3),
        "later_blocked_s": [round(r["blocked_s"], 3) for r in later],
        "later_one_copy_s": [round(r["one_copy_s"], 3) for r in later],
        "later_blocked_over_copy": [round(r["ratio"], 2) for r in later if r["ratio"] is not None],
        "complete_s": [round(r["complete_s"], 3) for r in rows if r["complete_s"] is not None],
        "median_step_s": round(result["median_step_s"], 3),
    }


def moe_figures(path: Path, stdout: str) -> dict[str, Any]:
    r = json.loads(path.read_text())
    return {
        **{f"{k}_ms": round(v, 3) for k, v in r["ms"].items()},
        **{f"{k}_tflops": round(v, 2) for k, v in r["tflops"].items()},
        "dispatch_combine_ms": round(r["dispatch_combine_ms"], 3),
        "moe_over_dense": round(r["moe_over_dense"], 2),
        "grouped_gemm": r["grouped_gemm"],
    }


def cp_figures(path: Path, stdout: str) -> dict[str, Any]:
    """``<mode>_cp<cp>_<seq>``: ms per fwd+bwd and peak MiB; from the table printed so far if no JSON."""
    if path.exists():
        rows = json.loads(path.read_text())
        cells = {(r["mode"], 1 if r["mode"] == "sdpa" else r["cp"], r["seq_len"]): r for r in rows}
        return {
            f"{m}_cp{cp}_{seq}": "oom" if r["ms"] is None else f"{r['ms']:.2f} ms, {r['peak_mib'] or 0:.0f} MiB"
            for (m, cp, seq), r in cells.items()
        }
    printed = re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \| ([^|]+) \| [^|]+ \| ([^|]+) \|$", stdout, flags=re.M)
    return {f"{m}_cp{cp}_{seq}": f"{ms.strip()} ms, {peak.strip()} MiB" for m, cp, seq, ms, peak in printed}


def steps() -> list[Step]:
    """Every check, in order of value (the order they run in)."""
    bare, tt = "vs_bare_loop.py", "vs_torchtitan.py"
    return [
        Step("planner", 90, planner_command, lambda p, s: json.loads(p.read_text())["predicted"], "planner.json"),
        Step("gpu_tests", 100, tests_command, tests_figures, from_stdout=True),
        Step("bare_bf16_compile", 150, side_by_side_command(bare, "bf16_compile"), bare_figures),
        Step("torchtitan_bf16_compile", 150, side_by_side_command(tt, "bf16_compile"), torchtitan_figures),
        Step("checkpoint_stall", 100, stall_command, stall_figures, "checkpoint_stall.json"),
        Step("bare_float8_rowwise", 130, side_by_side_command(bare, "compile_float8_rowwise"), bare_figures),
        Step("torchtitan_float8_rowwise", 130, side_by_side_command(tt, "compile_float8_rowwise"), torchtitan_figures),
        Step("moe_dispatch", 45, moe_command, moe_figures, "moe_dispatch.json"),
        Step("cp_kernels", 75, cp_command, cp_figures, "cp_kernels.json", from_stdout=True),
    ]


def output_of(step: Step, cmd: list[str]) -> Path | None:
    """The JSON a step writes: its declared file, else the command's ``--json`` argument."""
    if "--json" in cmd:
        return Path(cmd[cmd.index("--json") + 1])
    return None


# ---- running -------------------------------------------------------------------------------------
def run_step(cmd: list[str], limit_s: float, log: Path, env: dict[str, str]) -> tuple[str, float, str]:
    """``cmd`` in its own process group, killed whole at ``limit_s``: (status, seconds, output)."""
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            status = f"timed out ({limit_s:.0f} s)"
    return status, time.perf_counter() - start, log.read_text(errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the step's whole group (its own children and compile workers too)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def install(
    wheels: Path, site: Path, limit_s: float, log: Path, dry_run: bool = False
) -> tuple[str, float, dict[str, Any]]:
    """The wheel folder into ``site`` (offline, no dependency resolution: the folder is the closure).

    ``dry_run`` (smoke) lists the command only: the wheels are built for the GPU machine's Python.
    """
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        log.write_text(f"no wheels in {wheels}\n")
        return f"skipped (no wheels in {wheels})", 0.0, {}
    figures = {"wheels": len(found), "wheel_mib": round(sum(w.stat().st_size for w in found) / 2**20, 1)}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]
    if dry_run:
        log.write_text(shlex.join(cmd) + "\n")
        return "skipped (dry run)", 0.0, figures
    status, seconds, _ = run_step(cmd, limit_s, log, dict(os.environ))
    return status, seconds, figures


def child_env(site: Path) -> dict[str, str]:
    """The repo and the installed wheels ahead of the image's packages, for every step's process."""
    paths = [str(ROOT), str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def environment(site: Path) -> dict[str, Any]:
    """Device, versions (the installed wheels' included), date: the header of both reports."""
    import torch

    sys.path[:0] = [str(site)]
    versions = {}
    for pkg in ("lightning", "torchao", "torchtitan", "hydra-core"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "missing"
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/gpu_proof.py " + shlex.join(sys.argv[1:]),
    }


# ---- reports -------------------------------------------------------------------------------------
def write_reports(out: Path, header: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """``proof.json`` and ``proof.md``, rewritten after every step (partial results survive a kill)."""
    (out / "proof.json").write_text(json.dumps({**header, "steps": results}, indent=1) + "\n")
    (out / "proof.md").write_text(markdown(header, results))


def markdown(header: dict[str, Any], results: list[dict[str, Any]]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in header["versions"].items())
    lines = [
        f"device: {header['device']}; torch {header['torch']} (CUDA {header['cuda']}); {versions}; "
        f"{header['date']}; {header['mode']}",
        f"command: `{header['command']}`",
        "",
        "| step | status | seconds | figures |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        figures = "; ".join(f"{k} {_cell(v)}" for k, v in r["figures"].items())
        lines.append(f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {figures} |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text.replace("|", "/")


def with_prediction(step: Step, figures: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """The planner's peak for the lit-titan run of a side-by-side row, beside the measured one."""
    row = figures.get("row")
    if row and row in predicted.get("peak_gib", {}):
        figures["planner_peak_gib"] = predicted["peak_gib"][row]
    return figures


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    out, site = args.out, Path(args.site)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    header = {"mode": f"smoke ({args.smoke})" if args.smoke else "full", **environment(site)}
    results: list[dict[str, Any]] = []
    log = out / "logs" / "install.log"
    status, seconds, figures = install(args.wheels, site, min(120, args.budget), log, dry_run=bool(args.smoke))
    results.append({"step": "install", "status": status, "seconds": round(seconds, 1), "figures": figures})
    header = {**header, **environment(site)}  # the installed packages' versions
    write_reports(out, header, results)
    env, predicted = child_env(site), {}
    for step in steps():
        if args.only and step.name not in args.only:
            continue
        left = deadline - time.monotonic()
        limit = min(args.limits.get(step.name, args.default_limit or step.limit_s), left)
        result = {"step": step.name, "status": "skipped (no time left)", "seconds": 0.0, "figures": {}}
        if limit >= 20:
            result = run_one(step, args, limit, env, predicted)
            if step.name == "planner" and "predicted" in result:
                predicted = result.pop("predicted")
        results.append(result)
        write_reports(out, header, results)
    return results


def run_one(
    step: Step, args: argparse.Namespace, limit: float, env: dict[str, str], predicted: dict[str, Any]
) -> dict[str, Any]:
    """One step: run, then read its figures (whatever it wrote, even after a timeout)."""
    out = args.out
    try:
        cmd = step.command(args, out)
    except Exception as err:  # noqa: BLE001  (a step that cannot even be built is reported, the rest run)
        return {"step": step.name, "status": f"failed: {type(err).__name__}: {err}", "seconds": 0.0, "figures": {}}
    try:
        status, seconds, stdout = run_step(cmd, limit, out / "logs" / f"{step.name}.log", env)
    finally:  # checkpoints never outlive their step (the disk is small), even after a timeout
        shutil.rmtree(scratch_dir(args, step.name), ignore_errors=True)
    result: dict[str, Any] = {"step": step.name, "status": status, "seconds": round(seconds, 1), "command": cmd}
    path = out / step.output if step.output else output_of(step, cmd)
    figures: dict[str, Any] = {}
    try:
        if step.from_stdout or (path and path.exists()):
            figures = step.figures(path or Path(os.devnull), stdout)
    except Exception as err:  # noqa: BLE001  (unreadable output: the status and the log say the rest)
        figures = {"figures_error": f"{type(err).__name__}: {err}"[:200]}
    if step.name == "planner":
        result["predicted"] = figures
        figures = {k: v for k, v in figures.items() if k != "checkpoint_state_bytes"}
    if status != "ok" and not figures:
        figures = {"last_line": (stdout.strip().splitlines() or ["?"])[-1][:200]}
    result["figures"] = with_prediction(step, figures, predicted)
    return result


# ---- the planner's predictions (a child process: lit-titan's imports stay out of the driver) -------
def predict(path: Path, args: argparse.Namespace) -> None:
    """Predicted peak memory of each side-by-side row's lit-titan run; each stall job's checkpoint size."""
    import gpu_features

    from lit_titan.cli.plan import make_plan
    from lit_titan.models.llama3 import get_flavor
    from lit_titan.models.llama3.flops import count_params

    shape = argparse.Namespace(
        cpu_smoke=bool(args.smoke), layers=args.layers, seq_len=args.seq_len, tokenizer_vocab=32000, warmup=4, steps=8
    )
    rows = ["bf16_compile"] if args.smoke else ["bf16_compile", "compile_float8_rowwise"]
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            plan = make_plan(gpu_features.lit_overrides(gpu_features.CONFIGS[row], shape, Path(tmp)), write=False)
            peaks[row] = float(f"{plan['max_total_bytes'] / GIB:.3g}")
    states = {}
    for name, overrides in STALL_JOBS.items():
        model = dict(o.removeprefix("model.").split("=") for o in overrides)
        flavor = get_flavor("llama3_8b", **{"n_layers": 4, **{k: int(v) for k, v in model.items()}})
        states[name] = count_params(flavor) * STATE_BYTES_PER_PARAM
    path.write_text(json.dumps({"predicted": {"peak_gib": peaks, "checkpoint_state_bytes": states}}, indent=1))


# ---- entry -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=os.environ.get("OUT") or None, help="default: $OUT")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the offline wheel folder (gpu-wheels.sh)")
    p.add_argument("--site", default=str(Path(tempfile.gettempdir()) / "gpu-proof-site"))
    p.add_argument("--scratch", default=tempfile.gettempdir(), help="checkpoints go here, never under --out")
    p.add_argument(
        "--budget", type=float, default=None, help="seconds for everything (default 540: a device call allows 600)"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8, help="measured steps of each side-by-side run")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--only", nargs="+", choices=[s.name for s in steps()], default=None)
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="a step's own time limit")
    p.add_argument("--smoke", nargs="?", const="light", choices=("light", "full"), default=None)
    p.add_argument("--predict", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None and args.predict is None:
        p.error("--out is required when $OUT is not set")
    args.limits = {k: float(v) for k, v in (item.split("=", 1) for item in args.limit)}
    if args.budget is None:  # smoke: wall-clock limits for a GPU would fail a loaded CI machine
        args.budget = 3600 if args.smoke else 540
    args.default_limit = 600 if args.smoke else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.predict:
        predict(args.predict, args)
        return 0
    results = run_all(args)
    print((args.out / "proof.md").read_text())
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
