"""Chunked cross-entropy: equal to the unchunked loss, a fraction of its memory,
and the same training under TP loss parallel x FSDP and under pipeline parallelism."""

import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, assert_losses_match, losses, read_metrics
from lit_titan.models.llama3 import Transformer, get_flavor
from lit_titan.models.loss import chunked_cross_entropy, resolve_chunk_tokens
from paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from loss_memory import loss_peak  # noqa: E402


def _inputs(tokens=96, dim=32, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens // 2, dim, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    return hidden, weight, labels


def _loss_and_grads(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def _unchunked(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("chunk", [1, 40, 96, 500])  # one token, uneven chunks, exact, larger than the batch
def test_chunked_equals_unchunked_loss_and_grads(chunk):
    hidden, weight, labels = _inputs()
    ref = _loss_and_grads(_unchunked, hidden, weight, labels)
    got = _loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), hidden, weight, labels)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    assert ref[0] > 0 and ref[2].abs().sum() > 0


def test_chunked_under_compile_equals_eager():
    """torch.compile traces the checkpointed chunks (aot_eager: the graph capture is what is at stake)."""
    hidden, weight, labels = _inputs()
    ref = _loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 40), hidden, weight, labels)
    compiled = torch.compile(lambda h, w, y: chunked_cross_entropy(h, w, y, 40), backend="aot_eager", fullgraph=True)
    got = _loss_and_grads(compiled, hidden, weight, labels)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def test_model_head_loss_equals_logits_loss():
    """The model's labels= path (what training runs) equals cross-entropy over its logits; every grad."""
    args = get_flavor("llama3_debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 512, (2, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def run(chunk):
        model.zero_grad()
        model.output.chunk_tokens = chunk
        if chunk < 0:
            loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        else:
            loss = model(inputs, labels=labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = run(-1)
    for chunk in (0, 24):
        loss, grads = run(chunk)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_peak_memory_at_128k_vocab_is_under_a_quarter():
    """Allocation tracking (benchmarks/loss_memory.py): real tensors at 512 tokens; the 8,192-token
    row of docs/benchmarks.md uses FakeTensors, which this test shows track exactly the same bytes."""
    vocab, tokens, dim = 128256, 512, 16
    real_unchunked, real_chunked = loss_peak(vocab, tokens, dim, 0), loss_peak(vocab, tokens, dim, 64)
    assert real_unchunked >= 2 * tokens * vocab * 4  # the logits and their gradient at least
    assert real_chunked <= real_unchunked / 4
    assert loss_peak(vocab, tokens, dim, 0, fake=True) == real_unchunked
    assert loss_peak(vocab, tokens, dim, 64, fake=True) == real_chunked
    at_8k = loss_peak(vocab, 8192, dim, 1024, fake=True), loss_peak(vocab, 8192, dim, 0, fake=True)
    assert at_8k[0] <= at_8k[1] / 4


def test_auto_setting():
    assert resolve_chunk_tokens("auto", 128256) == 1024
    assert resolve_chunk_tokens("auto", 4096) == 0
    assert resolve_chunk_tokens(0, 128256) == 0 and resolve_chunk_tokens("256", 512) == 256
    with pytest.raises(ValueError, match="loss.chunk_tokens"):
        resolve_chunk_tokens("lots", 512)


def test_bad_setting_is_one_line_before_work():
    from lit_titan.config import ConfigError, compose, validate

    with pytest.raises(ConfigError, match="loss.chunk_tokens=-3"):
        validate(compose(["loss.chunk_tokens=-3"]))


# ---- training: chunked under TP loss parallel x FSDP and under PP equals one unchunked process -----
STEPS = 4
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "seed=0", "precision=32-true"]


@pytest.fixture(scope="module")
def unchunked_reference(tmp_path_factory, worlds):
    run_dir = tmp_path_factory.mktemp("unchunked")
    worlds.train([*COMMON, "cluster.devices=1", "loss.chunk_tokens=0"], run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["cluster.devices=4", "parallel.tp=2"],
        ["cluster.devices=4", "parallel.pp=2", "parallel.pp_schedule=1F1B"],
    ],
    ids=["dp2xtp2", "pp2xdp2"],
)
@pytest.mark.parity
def test_chunked_training_matches_unchunked_single_process(layout, unchunked_reference, tmp_path, worlds):
    worlds.train([*COMMON, *layout, "loss.chunk_tokens=48"], tmp_path)
    assert_losses_match(losses(tmp_path), losses(unchunked_reference), rtol=1e-5)
    got = [float(r["train/grad_norm"]) for r in read_metrics(tmp_path)]
    ref = [float(r["train/grad_norm"]) for r in read_metrics(unchunked_reference)]
    assert_losses_match(got, ref, rtol=1e-3)  # a wrong loss scale hides from AdamW's losses, not here


@pytest.mark.slow
def test_planner_counts_the_chunked_loss():
    from lit_titan.cli.plan import make_plan

    base = ["+recipe=llama3_8b_h100_8", "data.seq_len=8192"]
    off = make_plan([*base, "loss.chunk_tokens=0"])["per_rank"]["activation_detail"]
    auto = make_plan(base)["per_rank"]["activation_detail"]
    b, v = off["micro_batch"], 128256
    # fp32 log-probs, their gradient and the logits' gradient; one rank per node: tp 1 in this recipe
    assert off["loss"] == 12 * 8192 * b * v
    assert auto["loss"] == 12 * 1024 * v
    # the loss peak and a block's backward peak do not overlap: the total counts the larger
    assert off["loss"] > off["recompute_peak"] > auto["loss"]
    assert off["total"] - auto["total"] == off["loss"] - auto["recompute_peak"]
