"""Qwen3-MoE hyper-parameters, the named flavors (Hugging Face's published shapes) and the active FLOP count."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lit_titan.models.moe import MoEArgs
from lit_titan.settings import setting


@dataclass(frozen=True)
class Qwen3MoEArgs:
    # setting(): each field is also a config key, model.<name> (config/schema.py builds the schema from it)
    dim: int = setting(2048, ge=1)
    n_layers: int = setting(48, ge=1)
    n_heads: int = setting(32, ge=1)
    n_kv_heads: int = setting(4, ge=1)
    head_dim: int = setting(128, ge=2)  # Qwen3 sets it apart from dim // n_heads
    vocab_size: int = setting(151936, ge=1)
    # width of the dense layers (mlp_only_layers / decoder_sparse_step), HF intermediate_size
    ffn_dim: int = setting(6144, ge=1)
    moe: MoEArgs = setting(lambda: MoEArgs())
    norm_eps: float = setting(1e-6, gt=0)
    rope_theta: float = setting(1_000_000.0, gt=0)
    max_seq_len: int = setting(40960, ge=1)
    tie_embeddings: bool = setting(False)
    decoder_sparse_step: int = setting(1, ge=1)  # every K-th layer is MoE (index K-1, 2K-1, ...)
    mlp_only_layers: tuple[int, ...] = setting(())  # these layers stay dense
    attention: str = setting("sdpa", choices=("sdpa", "flex"))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe(self, layer: int) -> bool:
        """HF's rule (``Qwen3MoeDecoderLayer``)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def window_of(self, layer: int) -> None:
        return None

    def with_overrides(self, **overrides: Any) -> Qwen3MoEArgs:
        if isinstance(overrides.get("moe"), dict):  # a null sub-key keeps the flavor's value
            overrides["moe"] = replace(self.moe, **{k: v for k, v in overrides["moe"].items() if v is not None})
        if "mlp_only_layers" in overrides:
            overrides["mlp_only_layers"] = tuple(overrides["mlp_only_layers"])
        unknown = set(overrides) - set(asdict(self))
        if unknown:
            raise ValueError(f"unknown model argument(s) {sorted(unknown)}; valid: {sorted(asdict(self))}")
        return replace(self, **overrides)

    def validate(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        self.moe.validate()


def _qwen3(**kw: Any) -> Qwen3MoEArgs:
    return Qwen3MoEArgs(**kw)


FLAVORS: dict[str, Qwen3MoEArgs] = {
    # Trains on two CPU cores; the architecture of the real sizes (GQA, q/k norm, top-k of 8 experts).
    "qwen3_moe_debug": _qwen3(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=4096,
        ffn_dim=512,
        max_seq_len=2048,
        moe=MoEArgs(
            num_experts=8, top_k=2, hidden_dim=128, norm_topk_prob=True, aux_loss="pooled", aux_loss_coef=0.001
        ),
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3_30b_a3b": _qwen3(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        ffn_dim=6144,
        moe=MoEArgs(
            num_experts=128, top_k=8, hidden_dim=768, norm_topk_prob=True, aux_loss="pooled", aux_loss_coef=0.001
        ),
    ),
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3_235b_a22b": _qwen3(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        ffn_dim=12288,
        moe=MoEArgs(
            num_experts=128, top_k=8, hidden_dim=1536, norm_topk_prob=True, aux_loss="pooled", aux_loss_coef=0.001
        ),
    ),
}


def get_flavor(name: str, **overrides: Any) -> Qwen3MoEArgs:
    """Look up a flavor by name; unknown names fail with the list of valid ones."""
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; choose model=<one of {sorted(FLAVORS)}>")
    args = FLAVORS[name].with_overrides(**overrides) if overrides else FLAVORS[name]
    args.validate()
    return args


# ---- parameter and FLOP counts ---------------------------------------------------------------------
def _attention_params(a: Qwen3MoEArgs) -> int:
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return a.dim * (q + 2 * kv) + q * a.dim + 2 * a.head_dim  # q/k/v/o + q_norm, k_norm


def _ffn_params(a: Qwen3MoEArgs, layer: int, active: bool) -> int:
    if not a.is_moe(layer):
        return 3 * a.dim * a.ffn_dim
    m = a.moe
    experts = m.top_k if active else m.num_experts
    shared = 3 * a.dim * m.hidden_dim * m.num_shared_experts
    return a.dim * m.num_experts + 3 * a.dim * m.hidden_dim * experts + shared  # router + experts


def count_params(a: Qwen3MoEArgs, active: bool = False) -> int:
    """All parameters (``active=False``) or those one token uses: the router, top_k experts, shared ones."""
    blocks = sum(_attention_params(a) + _ffn_params(a, i, active) + 2 * a.dim for i in range(a.n_layers))
    head = 0 if a.tie_embeddings else a.vocab_size * a.dim
    return blocks + a.vocab_size * a.dim + head + a.dim


def flops_per_token(a: Qwen3MoEArgs, seq_len: int, num_params: int | None = None) -> float:
    """Training model FLOPs per token on ACTIVE parameters (the PaLM convention the dense count uses).

    ``6 * (active params - embedding) + 12 * n_heads * head_dim * seq_len * n_layers``: a token
    touches top_k experts, not all of them, so MFU counts what it computes. ``num_params`` (a built
    model's whole count, the registry's generic signature) is ignored: it counts every expert.
    """
    attention = 12 * a.n_heads * a.head_dim * seq_len * a.n_layers
    return float(6 * (count_params(a, active=True) - a.vocab_size * a.dim) + attention)
