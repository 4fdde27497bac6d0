"""Llama 3 parameter and model-FLOP counts, analytic (no model is built).

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; the same formula as TorchTitan's
``get_num_flop_per_token``)::

    flops_per_token = 6 * (N - N_embedding) + 12 * n_layers * n_heads * head_dim * seq_len

``N`` counts the parameters of the *whole* model (not this rank's FSDP shard / TP slice / PP
stage) and ``N_embedding = vocab_size * dim`` is the input embedding table (a lookup, no matmul);
the output head is a matmul and counts. ``6 * N`` is forward (2) + backward (4) FLOPs of the
weight matmuls per token; the second term is the attention score / value matmuls (QK^T and AV,
forward + backward) over the full sequence, without discounting the causal mask (as PaLM and
TorchTitan do). Activation recomputation is not counted: these are *model* FLOPs, hence MFU,
not hardware FLOPs utilisation.
"""

from __future__ import annotations

from lit_titan.models.llama3.args import ModelArgs


def count_params(model_args: ModelArgs, active: bool = False) -> int:
    """Parameters of the whole Llama 3 ``Transformer`` built from ``model_args`` (untied output head).

    Equals ``sum(p.numel() for p in Transformer(model_args).parameters())``; dense, so every token
    uses all of them (``active`` changes nothing).
    """
    dim, hd = model_args.dim, model_args.head_dim
    attention = dim * model_args.n_heads * hd * 2 + dim * model_args.kv_heads * hd * 2  # wq, wo, wk, wv
    ffn = 3 * dim * model_args.ffn_hidden_dim  # w1, w2, w3
    norms = 1 if model_args.parallel_block else 2  # the parallel block has one norm
    block = attention + ffn + norms * dim  # + attention_norm, ffn_norm
    return model_args.n_layers * block + 2 * model_args.vocab_size * dim + dim  # embedding, output, norm


def flops_per_token(model_args: ModelArgs, seq_len: int, num_params: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token (PaLM appendix B / TorchTitan).

    ``6 * (N - vocab_size * dim) + 12 * n_heads * head_dim * sum over layers of keys``, with ``N`` the
    whole model's parameter count (``num_params``, or analytically from ``model_args``) and keys per
    query counted as the convention does (``seq_len``, the causal half not subtracted) for a global layer
    and ``min(window, seq_len)`` for a sliding-window layer (``model.sliding_window``).
    """
    n = count_params(model_args) if num_params is None else int(num_params)
    n_embedding = model_args.vocab_size * model_args.dim
    windows = [model_args.window_of(i) for i in range(model_args.n_layers)]
    keys = sum(seq_len if w is None else min(w, seq_len) for w in windows)
    attention = 12 * model_args.n_heads * model_args.head_dim * keys
    return float(6 * (n - n_embedding) + attention)
