"""lit-titan: composable 3D/4D-parallel LLM pre-training inside the Lightning Trainer."""

from __future__ import annotations

from typing import Any

from lit_titan import known_warnings

known_warnings.install()  # dependency messages a user cannot act on (the list and the reasons: that module)

__all__ = ["PretrainModule", "TitanStrategy"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): `from lit_titan import PretrainModule` works as before, but commands that need
    # no Lightning (lit-titan report, prepare's checks) do not pay its import on a busy machine.
    if name == "PretrainModule":
        from lit_titan.module import PretrainModule

        return PretrainModule
    if name == "TitanStrategy":
        from lit_titan.strategies import TitanStrategy

        return TitanStrategy
    raise AttributeError(f"module 'lit_titan' has no attribute {name!r}")
