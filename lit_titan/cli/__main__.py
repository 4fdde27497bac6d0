"""``python -m lit_titan.cli <command> ...``: ``lit-titan`` where the script is not on PATH."""

from lit_titan.cli.commands import main

main()
