"""Document boundaries inside packed samples: position ids that restart after every EOS.

A sample packs several documents separated by the EOS id. Positions counted from each
document's first token let rotary embeddings (and, later, block-causal attention) treat every
document as starting at 0, as the documents were written.
"""

from __future__ import annotations

import numpy as np


def document_ids(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """``[m, s+1]`` tokens -> ``[m, s]`` document index (0, 1, ...) of each input token.

    The token after an EOS starts the next document; block-causal attention lets a token see
    only earlier tokens of its own document (``data.document_masking``).
    """
    inputs = np.asarray(tokens)[:, :-1]
    starts = np.zeros(inputs.shape, dtype=np.int64)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return np.cumsum(starts, axis=1)


def crossing_labels(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """``[m, s+1]`` tokens -> ``[m, s]``: True where an input is an EOS, whose label is the next document's first
    token. Under block-causal attention nothing that token sees predicts it, so the loss ignores it
    (``data.cross_document_labels=false``, the default with ``data.document_masking``)."""
    return np.asarray(tokens)[:, :-1] == eos_id


def document_positions(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """``[m, s+1]`` tokens -> ``[m, s]`` positions of the inputs ``tokens[:, :-1]``.

    The token after an EOS is position 0; the first token of a sample continues nothing it can
    see, so it is 0 too.
    """
    inputs = np.asarray(tokens)[:, :-1]
    m, s = inputs.shape
    idx = np.broadcast_to(np.arange(s, dtype=np.int64), (m, s))
    starts = np.zeros((m, s), dtype=np.int64)
    starts[:, 1:] = np.where(inputs[:, :-1] == eos_id, idx[:, 1:], 0)
    return idx - np.maximum.accumulate(starts, axis=1)
