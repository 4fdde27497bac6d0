"""Precision traps of the GPU path, proven on CPU.

- rotary cos/sin tables reach attention in fp32 under bf16 FSDP mixed precision (FSDP2 casts every
  unit's floating-point forward inputs by default, which rounded them to bf16);
- TF32 matmuls for ``32-true`` on CUDA only (the decision, and its config key);
- grouped-query attention through SDPA's ``enable_gqa``: no repeated K/V, same outputs;
- selective activation checkpointing recomputes no matmul and no attention in backward (counted with
  a dispatch mode, against no checkpointing and full checkpointing), and names cuDNN attention.
"""

from __future__ import annotations

from collections import Counter

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lit_titan import PretrainModule, TitanStrategy
from lit_titan.models.llama3 import Transformer, get_flavor
from lit_titan.models.llama3.model import Attention, CoreAttention
from lit_titan.strategies.precision import float32_matmul_precision
from lit_titan.strategies.transforms import _SAVE_OPS, apply_activation_checkpointing

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
ARGS = get_flavor("llama3_debug", **TINY)


def seeded_model(seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


# ---- rotary tables under bf16 FSDP --------------------------------------------------------------
class _RecordAttentionInputs(L.Callback):
    """dtypes that reach every Attention (x, cos, sin) and CoreAttention (q, k, v) in training."""

    def __init__(self) -> None:
        self.attention: list[tuple[torch.dtype, ...]] = []
        self.core: list[tuple[torch.dtype, ...]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        for m in pl_module.model.modules():
            if isinstance(m, Attention):
                m.register_forward_pre_hook(lambda _, args: self.attention.append(tuple(a.dtype for a in args)))
            elif isinstance(m, CoreAttention):
                m.register_forward_pre_hook(lambda _, args: self.core.append(tuple(a.dtype for a in args)))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_rope_tables_reach_attention_in_fp32_under_bf16_fsdp(precision):
    """One process: TitanStrategy applies FSDP2 whenever a param dtype is set, as on a GPU fleet."""
    torch.manual_seed(0)
    batches = [torch.randint(0, 512, (2, 33)) for _ in range(2)]
    record = _RecordAttentionInputs()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        strategy=TitanStrategy(),
        precision=precision,
        logger=False,
        callbacks=[record],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(PretrainModule("llama3_debug", TINY), train_dataloaders=DataLoader(batches, batch_size=None))
    assert trainer.strategy.fsdp_applied
    assert len(record.attention) == len(record.core) == TINY["n_layers"]
    for x, cos, sin in record.attention:
        assert (x, cos, sin) == (torch.bfloat16, torch.float32, torch.float32)  # activations stay bf16
    assert all(dtypes == (torch.bfloat16,) * 3 for dtypes in record.core)  # rotated q/k back in bf16


def test_bf16_rope_tables_would_cost_accuracy():
    """Why the dtype matters: tables rounded to bf16 move rotated queries by ~1e-3 relative, fp32 by ~1e-7."""
    from lit_titan.models.llama3.model import apply_rotary_emb, rope_tables

    args = get_flavor("llama3_8b")
    cos, sin = (t[:4096] for t in rope_tables(args))
    x = torch.randn(1, 4096, 2, args.head_dim, dtype=torch.float64)
    exact = apply_rotary_emb(x, cos.double(), sin.double())

    def err(c, s):
        return ((apply_rotary_emb(x, c.double(), s.double()) - exact).norm() / exact.norm()).item()

    assert err(cos, sin) < 1e-6
    assert err(cos.bfloat16(), sin.bfloat16()) > 5e-4


# ---- TF32 ---------------------------------------------------------------------------------------
def test_tf32_only_for_fp32_training_on_cuda():
    assert float32_matmul_precision("32-true", "cuda") == "high"
    assert float32_matmul_precision("32", "cuda") == "high"
    assert float32_matmul_precision("32-true", "cuda", tf32=False) is None
    for precision in ("bf16-mixed", "bf16-true"):
        assert float32_matmul_precision(precision, "cuda") is None
    assert float32_matmul_precision("32-true", "cpu") is None


def test_tf32_config_key_reaches_the_strategy():
    from lit_titan.config import compose
    from lit_titan.job.build import build_strategy

    assert build_strategy(compose([])).tf32 is True
    assert build_strategy(compose(["tf32=false"])).tf32 is False


def test_strategy_sets_tf32_on_cuda_and_restores_it(monkeypatch):
    """The strategy's wiring, with its device pretended to be a GPU (nothing runs on it)."""
    monkeypatch.setattr(TitanStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    before = torch.get_float32_matmul_precision()
    strategy = TitanStrategy()  # Lightning's default precision plugin: 32-true
    try:
        strategy._set_matmul_precision()
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        strategy._restore_matmul_precision()
    assert torch.get_float32_matmul_precision() == before == "highest"
    off = TitanStrategy(tf32=False)
    off._set_matmul_precision()
    assert torch.get_float32_matmul_precision() == "highest"


# ---- grouped-query attention --------------------------------------------------------------------
class _RecordSDPA(TorchDispatchMode):
    """Shapes of (q, k, v) of every SDPA forward kernel call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Size, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and not name.endswith("backward"):
            self.calls.append(tuple(a.shape for a in args[:3]))
        return func(*args, **(kwargs or {}))


def _repeat_kv_attention(q, k, v):
    """The previous implementation: K/V materialised at query-head width."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1), is_causal=True
    )


def test_gqa_attention_keeps_kv_heads_and_matches_repeated_kv():
    model = seeded_model()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with _RecordSDPA() as sdpa:
        logits = model(tokens)
    assert len(sdpa.calls) == ARGS.n_layers
    for q, k, v in sdpa.calls:
        assert (q[1], k[1], v[1]) == (ARGS.n_heads, ARGS.kv_heads, ARGS.kv_heads)  # no [b, heads, s, d] K/V copy
    reference = seeded_model()
    for block in reference.layers.values():
        block.attention.core.forward = _repeat_kv_attention
    with torch.no_grad():
        diff = (logits - reference(tokens)).abs().max() / logits.abs().max()
    assert diff <= 1e-6, diff


# ---- selective activation checkpointing ---------------------------------------------------------
def _is_recomputable(name: str) -> bool:
    """Matmuls and attention forward kernels: what selective_op promises not to run again in backward."""
    return name in ("mm", "addmm", "bmm") or (name.startswith("_scaled_dot_product") and not name.endswith("backward"))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if _is_recomputable(name):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _backward_counts(mode: str) -> Counter[str]:
    model = seeded_model()
    assert apply_activation_checkpointing(model, model.layers, mode) == (0 if mode == "none" else ARGS.n_layers)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    with _CountOps() as ops:
        loss.backward()
    return ops.counts


def test_selective_op_recomputes_no_matmul_and_no_attention_in_backward():
    none, selective, full = (_backward_counts(mode) for mode in ("none", "selective_op", "full"))
    # Full checkpointing reruns every block's forward (up to the last tensor backward needs: 6 of the
    # 7 projections, w2's output is not needed): the counter sees recomputation when it happens.
    attention = sum(n for name, n in full.items() if name.startswith("_scaled_dot_product"))
    assert attention == ARGS.n_layers and full["mm"] == none["mm"] + 6 * ARGS.n_layers, (full, none)
    # Selective per-op: backward runs exactly the matmuls it runs without any checkpointing.
    assert selective == none, (selective, none)
    assert not any(name.startswith("_scaled_dot_product") for name in none)


def test_save_list_names_every_attention_kernel_this_torch_has():
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(torch.ops.aten, name):
            assert getattr(torch.ops.aten, name).default in _SAVE_OPS, name
    assert hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")  # torch 2.11-2.15 all have it
