"""What every layout shares, checked against an implementation that is not ours: Hugging Face
``transformers``' ``LlamaForCausalLM`` (eager attention, not our SDPA path) on the same weights and batch.

Every parity test compares a layout with the same code on one process, so a bug in what all layouts
share (rotary scaling, tied-embedding gradients, grouped-query attention, document masking, the loss
normaliser) cannot show there. Here one training step's per-parameter gradients (fp64) must equal the
reference's, for Llama 3.1 with rope scaling engaged, Llama 3.2 with tied embeddings, GQA, a packed
batch with document masking against each document run alone, and gradient accumulation through a
real Lightning fit against ``F.cross_entropy`` over the concatenated global batch.

Tolerance: transformers computes RMSNorm and the attention softmax in fp32 whatever the model's dtype, which set
a floor of 4e-7. Here they run in the input's dtype (``tests/support/hf_input_dtype.py``, a test-side shim: the
same formulas, bitwise transformers' numbers in fp32), and the worst per-parameter max relative error measured is
1.6e-15 (the accumulated Lightning step; 1.2e-15 the one-step cases; both sides' rotary tables are fp32, and
equal). ``RTOL`` = 2e-14 sits about 10x above it; the bugs it must catch (loss normaliser, rope scaling,
tied-embedding gradient) move gradients by 1e-2 or more. ``SHIFTED_RTOL`` bounds positions continuing across
documents instead of restarting: they rotate by other fp32 angles (rotary embeddings are relative only up to that
rounding: 1.7e-7 measured).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from hf_input_dtype import in_input_dtype
from lit_titan.data import documents as data_documents  # looked up at call time: tests/support/mutants patch it
from lit_titan.models.llama3 import Transformer, get_flavor, hf
from lit_titan.models.llama3.args import RopeScaling
from lit_titan.module import PretrainModule

RTOL = 2e-14
SHIFTED_RTOL = 2e-6
VOCAB, SEQ = 512, 48
# Engaged at a tiny sequence: wavelengths above 64 tokens are slowed 8x (Llama 3.1's rule, its 8192
# scaled down), so at 48 positions most rotary dims turn by a different angle than unscaled.
ROPE31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
ROPE32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
CASES = {  # name: (tie_embeddings, rope_scaling, n_kv_heads); n_heads = 4
    "llama3.1-rope-scaled-gqa": (False, ROPE31, 2),
    "llama3.2-tied-mqa": (True, ROPE32, 1),
}


def _args(tie: bool, scaling: RopeScaling | None, kv_heads: int = 2):
    return get_flavor(
        "llama3_debug",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        vocab_size=VOCAB,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=scaling,
        tie_embeddings=tie,
        max_seq_len=256,
    )


def _ours(args, chunk_tokens: int = 0) -> Transformer:
    with torch.device("meta"):  # built as every strategy builds it: meta, to_empty, seeded init
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.double()
    model.init_buffers("cpu")
    with torch.no_grad():  # sharpen attention so rotary positions and masking weigh in the gradients
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(10.0)
            layer.attention.wk.weight.mul_(10.0)
    model.output.chunk_tokens = chunk_tokens
    return model


def _reference(ours: Transformer) -> LlamaForCausalLM:
    """transformers' model holding our weights (through hf.py's names and rotary permutation)."""
    config = hf.hf_config(ours.args)
    for key in ("torch_dtype", "dtype", "architectures", "model_type"):
        config.pop(key, None)
    ref = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager")).double()
    missing, unexpected = ref.load_state_dict(hf.to_hf_state_dict(ours.state_dict(), ours.args), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if ours.args.tie_embeddings else [])
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) is ours.args.tie_embeddings
    return ref


def _ref_nll_sum(ref: LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of rows ``tokens`` [b, s+1] through transformers (logits only: its own loss
    upcasts to fp32, ``F.cross_entropy`` here stays fp64)."""
    logits = ref(tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def _grad_errors(got: dict[str, torch.Tensor], ref: LlamaForCausalLM) -> dict[str, float]:
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert got.keys() == want.keys()
    errors = {}
    for name, w in want.items():
        assert w is not None and w.abs().max() > 0, name
        errors[name] = ((got[name] - w).abs().max() / w.abs().max()).item()
    return errors


def _assert_grads_equal(got: dict[str, torch.Tensor], ref: LlamaForCausalLM, rtol: float = RTOL) -> None:
    """Each gradient ``got`` (HF names, HF rotary layout) against the reference's: max |diff| / max |ref|.
    Fails naming the worst parameter and how many exceed ``rtol``."""
    errors = _grad_errors(got, ref)
    worst = max(errors, key=errors.get)
    bad = sum(e >= rtol for e in errors.values())
    assert not bad, (
        f"{worst}: max relative gradient error {errors[worst]:.3g} >= {rtol:g} ({bad} of {len(errors)} parameters over)"
    )


def _grads(ours: Transformer) -> dict[str, torch.Tensor]:
    """Our model's gradients under HF names, in HF's rotary layout (hf.py's export mapping)."""
    return dict(hf.to_hf_tensor(n, p.grad, ours.args) for n, p in ours.named_parameters())


def _tokens(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_step_gradients_equal_transformers(case):
    tie, scaling, kv_heads = CASES[case]
    args = _args(tie, scaling, kv_heads)
    tokens = _tokens(2)
    ref = _reference(_ours(args))
    # The regime: transformers' scaled frequencies turn the last position's rotary angles far from unscaled.
    unscaled = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    assert ((ref.model.rotary_emb.inv_freq - unscaled) * (SEQ - 1)).abs().max() > 0.5
    (_ref_nll_sum(ref, tokens) / tokens[:, 1:].numel()).backward()
    for chunk in (0, 40):  # the head's loss unchunked and in uneven token chunks (loss.chunk_tokens)
        ours = _ours(args, chunk)
        ours(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        _assert_grads_equal(_grads(ours), ref)


@pytest.fixture(autouse=True)
def _transformers_in_input_dtype(monkeypatch):
    in_input_dtype(monkeypatch)


def test_the_shim_gives_transformers_own_numbers_in_fp32(monkeypatch):
    """The shim changes only the dtype: in fp32 transformers' loss (its own) and gradients are bitwise the same."""

    def step() -> list[torch.Tensor]:
        ref = _reference(_ours(_args(*CASES["llama3.1-rope-scaled-gqa"]))).float()
        tokens = _tokens(2)
        loss = ref(tokens, labels=tokens).loss
        loss.backward()
        return [loss, *(p.grad for p in ref.parameters())]

    shimmed = step()
    monkeypatch.undo()
    plain = step()
    assert all(torch.equal(a, b) for a, b in zip(shimmed, plain, strict=True))


EOS = 0


def _packed_rows() -> torch.Tensor:
    """Two rows of SEQ + 1 tokens, packed from 3 and 2 documents (EOS ends one; the next token starts one)."""
    rows = _tokens(2, seed=1)
    rows[0, [9, 25]] = EOS
    rows[1, [30]] = EOS
    return rows


def _packed_reference():
    """The packed rows, their positions (``data.document_positions``) and document ids, and transformers
    after a backward of each document run alone as its own sequence."""
    args = _args(False, ROPE31)
    rows = _packed_rows()
    positions = torch.from_numpy(data_documents.document_positions(rows.numpy(), EOS))
    documents = torch.from_numpy(data_documents.document_ids(rows.numpy(), EOS))
    assert documents.max(dim=1).values.tolist() == [2, 1]

    ref = _reference(_ours(args))
    total = 0
    for r in range(rows.shape[0]):
        for d in documents[r].unique().tolist():
            idx = (documents[r] == d).nonzero().flatten()
            total = total + _ref_nll_sum(ref, rows[r : r + 1, int(idx[0]) : int(idx[-1]) + 2])
    (total / rows[:, 1:].numel()).backward()
    return args, rows, positions, documents, ref


def packed_positions_error() -> tuple[float, str]:
    """The worst relative gradient error (and its parameter) of the packed batch with the data path's
    positions against each document alone: what tests/parity/test_mutants.py measures a positions mutant by."""
    with pytest.MonkeyPatch.context() as patch:  # called outside this module's tests too
        in_input_dtype(patch)
        args, rows, positions, documents, ref = _packed_reference()
        ours = _ours(args)
        ours(rows[:, :-1], positions, labels=rows[:, 1:], documents=documents).backward()
    errors = _grad_errors(_grads(ours), ref)
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def test_packed_documents_equal_each_document_alone_in_transformers():
    """Document masking: the packed batch's gradients equal those of each document run alone through
    transformers as its own sequence (its labels: its tokens after the first, and the first token after
    it, as the packed row holds them), with positions restarting per document (``data.document_positions``)
    and continuing across them (rotary embeddings are relative: the same up to rounding)."""
    args, rows, positions, documents, ref = _packed_reference()
    for pos, rtol in ((positions, RTOL), (None, SHIFTED_RTOL)):
        ours = _ours(args)
        ours(rows[:, :-1], pos, labels=rows[:, 1:], documents=documents).backward()
        _assert_grads_equal(_grads(ours), ref, rtol)

    # Sensitivity: without the mask, later documents see earlier ones and the gradients move.
    unmasked = _ours(args)
    unmasked(rows[:, :-1], positions, labels=rows[:, 1:]).backward()
    with pytest.raises(AssertionError, match="max relative gradient error"):
        _assert_grads_equal(_grads(unmasked), ref, rtol=100 * RTOL)


def test_document_boundary_labels_are_ignored_as_each_document_alone_in_transformers():
    """``data.document_masking`` ignores the label that crosses into the next document (an EOS's label, the next
    document's first token, which nothing it attends to predicts; ``data.cross_document_labels=false``). Through
    the module's label path (``inputs_and_labels`` over the data's ``ignore`` mask), the packed batch's gradients
    equal each document run alone through transformers with its own labels only, normalised by their count;
    training the crossing labels (the old behaviour) fails the same comparison."""
    args = _args(False, ROPE31)
    rows = _packed_rows()
    batch = {
        "tokens": rows,
        "documents": torch.from_numpy(data_documents.document_ids(rows.numpy(), EOS)),
        "positions": torch.from_numpy(data_documents.document_positions(rows.numpy(), EOS)),
        "ignore": torch.from_numpy(data_documents.crossing_labels(rows.numpy(), EOS)),
    }
    module = PretrainModule("llama3_debug", loss_chunk_tokens=0)
    inputs, labels, extra = module.inputs_and_labels(batch)
    assert int((labels == -100).sum()) == 3  # the three EOS of the two rows

    ref = _reference(_ours(args))
    total, count = 0, 0
    for r in range(rows.shape[0]):
        for d in batch["documents"][r].unique().tolist():
            idx = (batch["documents"][r] == d).nonzero().flatten()
            first, last = int(idx[0]), int(idx[-1])
            end = last + 1 if int(rows[r, last]) == EOS else last + 2  # a document cut by the row end continues
            total = total + _ref_nll_sum(ref, rows[r : r + 1, first:end])
            count += end - first - 1
    (total / count).backward()

    ours = _ours(args)
    ours(inputs, extra["positions"], labels=labels, documents=extra["documents"]).backward()
    _assert_grads_equal(_grads(ours), ref)

    crossing = _ours(args)  # the crossing labels trained: every document's gradients move
    crossing(inputs, extra["positions"], labels=rows[:, 1:], documents=extra["documents"]).backward()
    with pytest.raises(AssertionError, match="max relative gradient error"):
        _assert_grads_equal(_grads(crossing), ref, rtol=100 * RTOL)


class _GradsBeforeStep(L.Callback):
    """The accumulated gradients the optimizer would apply (before clipping and the step)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def test_accumulated_step_normalises_by_the_global_batch(tmp_path):
    """A real Lightning fit of PretrainModule, fp64, two micro-batches of 2 sequences accumulated into
    one step: the gradients equal those of ``F.cross_entropy`` (mean) over the concatenated global batch
    of 4 sequences through transformers. A per-micro-batch sum, a missing division by the accumulation
    count, or a mean over one micro-batch only all fail here."""
    tie, scaling, kv_heads = CASES["llama3.1-rope-scaled-gqa"]
    args = _args(tie, scaling, kv_heads)
    overrides = {
        k: getattr(args, k)
        for k in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "norm_eps",
            "rope_theta",
            "rope_scaling",
            "tie_embeddings",
            "max_seq_len",
        )
    }
    module = PretrainModule("llama3_debug", model_overrides=overrides, seed=0, loss_chunk_tokens=0)
    reference_weights = _ours(args)

    def sharpened_like_reference() -> None:
        module.model.load_state_dict(reference_weights.state_dict())

    module.load_initial_weights = sharpened_like_reference
    tokens = _tokens(4, seed=2)
    probe = _GradsBeforeStep()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader(list(tokens), batch_size=2, shuffle=False)
    trainer.fit(module, loader)
    assert next(module.model.parameters()).dtype == torch.float64

    ref = _reference(reference_weights)
    logits = ref(tokens[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    _assert_grads_equal(dict(hf.to_hf_tensor(n, g, args) for n, g in probe.grads.items()), ref)
