"""``lit-titan report RUN_DIR``: RUN_DIR/report.html (lit_titan/report/)."""

from __future__ import annotations

import sys

from lit_titan.cli.entry import run_entry_point
from lit_titan.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    from lit_titan.report import make_report

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(
            "usage: lit-titan report RUN_DIR   (a run_dir= of a training job, or a sweep directory)\n"
            "writes RUN_DIR/report.html: a self-contained page with the run's plots\n\n"
            "examples:\n  lit-titan report runs/llama3_debug-20261123-211400\n"
            "  lit-titan report runs/my-sweep                          # every point of a sweep\n"
            "  python -m lit_titan.train callbacks=[throughput,timeline,profiler] callbacks.profiler.steps=[3,4] "
            "run_dir=runs/traced && lit-titan report runs/traced   # with per-rank traces",
            file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout,
        )
        sys.exit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    print(f"lit-titan: report written to {make_report(argv[0])}")


if __name__ == "__main__":
    run_entry_point(main, (ConfigError,))
