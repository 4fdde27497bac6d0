"""lit-titan: composable 3D/4D-parallel LLM pre-training inside the Lightning Trainer."""

from lit_titan.module import PretrainModule
from lit_titan.strategies import TitanStrategy

__all__ = ["PretrainModule", "TitanStrategy"]
__version__ = "0.1.0"
