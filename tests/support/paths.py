"""Where things are, for tests in any folder of tests/ (a test's own ``Path(__file__)`` depends on its folder)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]  # the repository: README.md, docs/, notebooks/, benchmarks/, lit_titan/
SCRIPTS = SUPPORT / "scripts"  # run by path (command lines) or as ``scripts.NAME:main`` in the worlds
