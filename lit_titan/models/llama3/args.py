"""Llama 3.1 / 3.2 hyper-parameters and the named flavors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lit_titan.settings import setting


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 rotary frequency scaling (the published defaults)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    # setting(): each field is also a config key, model.<name> (config/schema.py builds the schema from it)
    dim: int = setting(4096, ge=1)
    n_layers: int = setting(32, ge=1)
    n_heads: int = setting(32, ge=1)
    n_kv_heads: int | None = setting(None, ge=1)
    vocab_size: int = setting(128256, ge=1)
    multiple_of: int = setting(256, ge=1)
    ffn_dim_multiplier: float | None = setting(None, gt=0)
    norm_eps: float = setting(1e-5, gt=0)
    rope_theta: float = setting(500000.0, gt=0)
    rope_scaling: RopeScaling | None = setting(lambda: RopeScaling())
    max_seq_len: int = setting(131072, ge=1)
    # Scale the std of output projections by depth (TorchTitan's depth_init).
    depth_init: bool = setting(True)
    # One weight for the input embedding and the output head (Llama 3.2 1B/3B).
    tie_embeddings: bool = setting(False)
    # Attention kernel: sdpa | flex (models/llama3/attention.py); same numerics, flex skips masked blocks.
    attention: str = setting("sdpa", choices=("sdpa", "flex"))
    # GPT-J/PaLM block: x + attn(norm(x)) + mlp(norm(x)), one norm; under TP one reduction per block, not two
    parallel_block: bool = setting(False)
    # Sliding-window attention: a token sees itself and the previous sliding_window - 1 tokens (None: all).
    sliding_window: int | None = setting(None, ge=1)
    # With a window: None = every layer windowed; K = every K-th layer (index K-1, 2K-1, ...) stays global.
    window_pattern: int | None = setting(None, ge=1)
    # muP (models/mup.py): hidden init, per-layer lr, logit and attention scales follow the width multiplier
    # dim / mup_base_width, so an lr tuned at the base width transfers; base width = dim is the standard model
    mup: bool = setting(False)
    mup_base_width: int | None = setting(None, ge=1)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width as in Meta's reference: 2/3 of 4*dim, scaled, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def width_multiplier(self) -> float:
        """muP's m = dim / mup_base_width (1.0 without muP: the standard parametrisation)."""
        return self.dim / self.mup_base_width if self.mup and self.mup_base_width else 1.0

    def window_of(self, layer: int) -> int | None:
        """The attention window of block ``layer`` (None: full causal)."""
        if self.sliding_window is None:
            return None
        if self.window_pattern is not None and (layer + 1) % self.window_pattern == 0:
            return None
        return self.sliding_window

    def with_overrides(self, **overrides: Any) -> ModelArgs:
        if isinstance(overrides.get("rope_scaling"), dict):
            overrides["rope_scaling"] = RopeScaling(**overrides["rope_scaling"])
        unknown = set(overrides) - set(asdict(self))
        if unknown:
            raise ValueError(f"unknown model argument(s) {sorted(unknown)}; valid: {sorted(asdict(self))}")
        return replace(self, **overrides)

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.kv_heads}")
        if self.attention not in ("sdpa", "flex"):
            raise ValueError(f"model.attention={self.attention!r}; choose sdpa or flex")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model.sliding_window={self.sliding_window} must be >= 1 (or null for full attention)")
        if self.window_pattern is not None and self.window_pattern < 1:
            raise ValueError(f"model.window_pattern={self.window_pattern} must be >= 1 (or null: every layer windowed)")
        if self.mup and self.mup_base_width is None:
            raise ValueError(
                "model.mup=true: needs model.mup_base_width, the width (model.dim) the learning rate was tuned "
                "at; set e.g. model.mup_base_width=256 (= model.dim: the standard parametrisation)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary embeddings")


FLAVORS: dict[str, ModelArgs] = {
    # Small enough to train on two CPU cores; same architecture as the real sizes.
    "llama3_debug": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=4096,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    "llama3_8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
    ),
    "llama3_70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
    ),
    "llama3_405b": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}


# Llama 3.2 (text): rotary scaling factor 32 from 8K, tied embeddings (Meta's params.json / HF config).
_LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
FLAVORS.update(
    {
        "llama3_2_1b": ModelArgs(
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim_multiplier=1.5,
            multiple_of=256,
            rope_scaling=_LLAMA32_ROPE,
            tie_embeddings=True,
        ),
        "llama3_2_3b": ModelArgs(
            dim=3072,
            n_layers=28,
            n_heads=24,
            n_kv_heads=8,
            ffn_dim_multiplier=1.0,
            multiple_of=256,
            rope_scaling=_LLAMA32_ROPE,
            tie_embeddings=True,
        ),
    }
)


def get_flavor(name: str, **overrides: Any) -> ModelArgs:
    """Look up a flavor by name; unknown names fail with the list of valid ones."""
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; choose model=<one of {sorted(FLAVORS)}>")
    args = FLAVORS[name].with_overrides(**overrides) if overrides else FLAVORS[name]
    args.validate()
    return args
