"""``lit-titan verify [OVERRIDES]``: prove a job's layout equal to one process, on a shrunk copy of the job.

Takes the training command line (model, layout, optimizer, callbacks, your module by ``module._target_``),
trains a shrunk copy of it (fewer layers, a short sequence, a small batch, ``verify.steps`` steps, float64)
under its layout and in one process, and prints per-parameter gradient ratios and errors before clipping, the
clip norm, the weights after each step, the losses, a known-norm check and a replica check, the worst entry
and a verdict. Exit code 0: equal; 1: not (or a side failed); 2: bad input. docs/verify.md.

    lit-titan verify cluster.devices=4 parallel.tp=2
    lit-titan verify model=qwen3_moe_debug cluster.devices=4 parallel.ep=2 module._target_=my_pkg.MyModule
    torchrun --nproc-per-node 8 -m lit_titan.cli.verify +recipe=llama3_8b_h100_8 model.dim=1024

Verify keys: verify.steps=N (3), verify.precision=64-true|32-true, verify.top=N (table rows, 10).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from lit_titan.cli.usage import render

        print(render("verify", intro=__doc__.strip(), examples=False))
        return 0
    from lit_titan.job.ranks import is_rank_of_a_job

    if is_rank_of_a_job():
        return _under_launcher(argv)
    from lit_titan.verify.check import run_verify, split_keys

    verdict = run_verify(argv)
    print(verdict.render(top=int(split_keys(argv)[0]["verify.top"])))
    return 0 if verdict.passed else 1


def _under_launcher(argv: list[str]) -> int:
    """Every rank trains the layout; rank 0 then runs the reference in a process of its own and judges."""
    from lit_titan.cli.verify_side import run_side
    from lit_titan.job.ranks import is_launcher_rank_zero
    from lit_titan.verify.check import run_verify

    def layout_here(side, overrides, run_dir: Path, steps, known_norm_step, processes) -> None:
        if side == "layout":
            run_side(overrides, str(run_dir), steps, known_norm_step)
        elif is_launcher_rank_zero():
            from lit_titan.verify.check import subprocess_runner

            subprocess_runner(side, overrides, run_dir, steps, known_norm_step, processes)
        else:
            raise SystemExit(0)  # the layout is done; rank 0 judges

    verdict = run_verify(argv, layout_here, on_one_host=False)
    print(verdict.render())
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import user_errors

    def run() -> None:
        code = main()
        if code:
            raise SystemExit(code)

    run_entry_point(run, user_errors)  # a side that failed: VerifyFailed's exit code 1
