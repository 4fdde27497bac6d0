"""The layering of the house, read off the imports: commands above the library, the planner below the run.

Static (the source's import statements, parsed): no process, no torch import, milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

from paths import ROOT

PACKAGE = ROOT / "lit_titan"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (``from a import b`` counts as a.b too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _library() -> list[Path]:
    """lit_titan/ without its commands: cli/ and the launchers' module, train.py."""
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "cli" and p != PACKAGE / "train.py"]


def test_nothing_in_the_library_imports_a_command():
    entry_points = ("lit_titan.cli", "lit_titan.train")
    offenders = {
        str(p.relative_to(PACKAGE)): sorted(m for m in _imports(p) if m.startswith(entry_points)) for p in _library()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_planner_fakes_no_trainer():
    """The planner asks for the callbacks' transforms with the functions their setup calls (strategies/transforms.py)."""
    sources = {p.name: p.read_text() for p in (PACKAGE / "planner").glob("*.py")}
    fakes = ("SimpleNamespace(strategy=", ".setup(", "Trainer(")
    assert not [name for name, text in sources.items() if any(fake in text for fake in fakes)]


def test_no_two_commands_import_each_other():
    """cli/ imports go one way (usage.py reads the command table in commands.py, not the reverse)."""
    modules = {f"lit_titan.cli.{p.stem}": _imports(p) for p in (PACKAGE / "cli").glob("*.py")}
    pairs = sorted((a, b) for a in modules for b in modules if a < b and b in modules[a] and a in modules[b])
    assert pairs == []


def test_one_place_owns_the_optimizer_step():
    """Backward and the zeroing of gradients happen in the step runner alone (strategies/step.py); the module's
    ``optimizer_zero_grad`` is Lightning's hook for strategies that are not lit-titan's, and a plain
    LightningModule's step is Lightning's own (the strategy hands its backward to ``super().backward(``)."""
    calls = (".backward(", "zero_grad()", "block_backward_sync()")

    def code(p: Path) -> str:
        return _code(p).replace("super().backward(", "")

    owners = {
        str(p.relative_to(PACKAGE)): sorted(c for c in calls if c in code(p))
        for p in _library()
        if any(c in code(p) for c in calls)
    }
    probe = {"models/moe.py": [".backward("]}  # whether this device's grouped GEMM has a backward: not training
    assert owners == {"strategies/step.py": sorted(calls), "module.py": ["zero_grad()"], **probe}, owners


def _code(path: Path) -> str:
    """The source without its comments (a comment may name a call)."""
    return "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())


def test_the_strategy_contract_imports_nothing_above_it():
    """``strategies/contract.py`` is what the module, the strategy and the callbacks agree on: it imports none of
    them (TitanStrategy says it keeps the contract by a class attribute), so no import circle runs through it."""
    above = ("lit_titan.strategies.strategy", "lit_titan.module", "lit_titan.callbacks")
    assert [m for m in _imports(PACKAGE / "strategies" / "contract.py") if m.startswith(above)] == []
