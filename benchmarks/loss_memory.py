"""Peak memory of the loss (head + cross-entropy, forward + backward), chunked vs unchunked, measured.

Method: allocation tracking. A ``TorchDispatchMode`` sees every op that runs (autograd's backward
ops included) and each tensor storage its outputs own; a storage is counted with its real size
(``untyped_storage().nbytes()``) when it first appears and uncounted when it is freed (a weakref
callback on the storage, which fires when its memory goes back to the allocator). The peak is the
maximum of the bytes alive at once, over forward + backward, on top of what existed before
(hidden states, weight, labels). Views and in-place results share a storage and count once.
(torch's profiler with ``profile_memory`` attributes allocations to ops, not to a timeline, on CPU.)

Usage:
    python benchmarks/loss_memory.py --vocab 128256 --tokens 8192 --dim 64 --chunk 1024
Prints a markdown table: variant, peak MiB, ratio to unchunked; ``--json FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lit_titan.models.loss import chunked_cross_entropy  # noqa: E402


class AllocationTracker(TorchDispatchMode):
    """Bytes of tensor storages created by ops while active and still alive; their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.current = self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.alive or storage.nbytes() == 0:
            return
        self.alive[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        self.refs[key] = weakref.ref(storage, lambda _, k=key: self._free(k))

    def _free(self, key: int) -> None:
        self.current -= self.alive.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def peak_bytes(fn) -> int:
    """Peak bytes of storages allocated by ``fn()`` and alive at once."""
    tracker = AllocationTracker()
    with tracker:
        fn()
    return tracker.peak


def loss_peak(vocab: int, tokens: int, dim: int, chunk: int, seed: int = 0, fake: bool = False) -> int:
    """Peak bytes of one loss forward + backward (chunk 0: unchunked) at the given sizes.

    ``fake``: the same ops on FakeTensors (sizes and lifetimes, no data, no real memory), for
    sizes this machine cannot hold; ``tests/unit/models/test_model_loss.py`` checks both agree exactly.
    """
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return loss_peak(vocab, tokens, dim, chunk, seed)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)

    def run() -> None:
        if chunk:
            loss = chunked_cross_entropy(hidden, weight, labels, chunk)
        else:
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
        loss.backward()

    return peak_bytes(run)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, nargs="+", default=[1024])
    parser.add_argument("--fake", action="store_true", help="FakeTensors: no real memory (see loss_peak)")
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    base = loss_peak(a.vocab, a.tokens, a.dim, 0, fake=a.fake)
    rows = [{"variant": "unchunked", "chunk_tokens": 0, "peak_mib": base / 2**20, "ratio": 1.0}]
    for c in a.chunk:
        p = loss_peak(a.vocab, a.tokens, a.dim, c, fake=a.fake)
        rows.append({"variant": f"chunked {c}", "chunk_tokens": c, "peak_mib": p / 2**20, "ratio": p / base})
    logits_mib = a.tokens * a.vocab * 4 / 2**20
    print(
        f"vocab {a.vocab}, tokens {a.tokens}, dim {a.dim}{' (fake tensors)' if a.fake else ''}; "
        f"fp32 logits alone: {logits_mib:.0f} MiB"
    )
    print("| variant | peak MiB (loss fwd+bwd) | ratio to unchunked |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_mib']:.0f} | {r['ratio']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
