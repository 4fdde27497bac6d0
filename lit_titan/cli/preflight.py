"""``lit-titan preflight``: the training job's layout, pre-flight diagnostics only.

The diagnostics live in ``lit_titan.observe.diagnostics`` and their callback in
``lit_titan.callbacks.preflight`` (training and the config check use them); this module is only the
command, which runs ``lit_titan.train``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """``lit-titan preflight [OVERRIDES]``: the training job's layout, diagnostics only (exit 2 when one is found).

    Same overrides as ``lit_titan.train`` (cluster, parallel, fault.slow_rank ...); ``preflight.action``
    defaults to ``stop`` here, so a script can test the exit code.
    """
    import sys

    from lit_titan.cli.entry import run_entry_point
    from lit_titan.cli.train import main as train_main
    from lit_titan.cli.train import user_errors
    from lit_titan.observe.diagnostics import PreflightFinished as Finished

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = ["preflight.enabled=true", "preflight.only=true", "checkpoint.enabled=false"]
    if not any(a.startswith("preflight.action=") for a in argv):
        extra.append("preflight.action=stop")

    def run() -> None:
        try:
            train_main([*argv, *extra])
        except Finished:
            pass

    run_entry_point(run, user_errors)


if __name__ == "__main__":
    main()


__all__ = ["main"]
