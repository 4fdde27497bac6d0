"""The Mixture-of-Experts feed-forward layer, shared by every MoE family (no parallelism in here).

Dropless token-choice top-k: every token goes to exactly ``top_k`` experts, no capacity limit, so
no token is ever dropped whatever the routing. Router logits and scores are computed in at least
fp32; ties between equal scores go to the lowest expert index (a stable sort, not ``topk``, whose
order on ties is unspecified and may differ between devices and ranks).

Experts are grouped weights ``w1``/``w3`` [E, hidden, dim] and ``w2`` [E, dim, hidden] (each
expert's slice is an ``nn.Linear`` weight: gate, up, down). They run as one ``torch._grouped_mm``
over tokens sorted by expert where the device and dtype support it (probed once: CPU on torch 2.15
has fp32/bf16 only and wants 16-byte aligned rows), and as a loop over experts otherwise (fp64).

Load balancing, chosen by ``MoEArgs``:
- ``aux_loss="pooled"``: Switch Transformer's loss pooled over all MoE layers, exactly as
  transformers' ``load_balancing_loss_func`` computes it (Qwen3-MoE's ``router_aux_loss_coef``);
- ``aux_loss="global"``: per layer, the token fractions counted over the whole batch (summed over
  ``count_group``, the data/context ranks, when one is set) times the local mean probabilities,
  averaged over layers (Qwen's global-batch balancing);
- ``aux_loss="sequence"``: DeepSeek-V3's sequence-wise loss, per sequence, averaged; under context
  parallel (``cp_group`` set) each rank holds part of every sequence, so the per-sequence counts and
  score sums are summed over the context ranks first;
- ``bias_update_rate > 0``: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to
  the scores for selection only, moved by ``update_expert_bias`` after each optimizer step from
  the token counts of the whole step.

The auxiliary loss travels one of two ways. By default the model adds ``moe_aux_loss`` of every
layer's statistics to the loss it returns. Inside a ``losses_in_backward`` scope (the pipeline
runner opens one: a stage returns no loss unless it is the last) each layer back-propagates its own
share itself (``injected_loss.add_to_backward``) and keeps the detached value for logging
(``take_injected_aux_loss``); the per-layer kinds (``global``, ``sequence``) allow that, the
``pooled`` one, a product of sums over every layer, does not (the config refuses it with pp > 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_titan.models.injected_loss import add_to_backward, backward_scale
from lit_titan.settings import setting

AUX_LOSSES = ("pooled", "global", "sequence", "none")
SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_IMPLS = ("auto", "grouped", "loop")
AUX_LOSS_COUNTS = ("micro_batch", "step")


@dataclass(frozen=True)
class MoEArgs:
    # setting(): each field is also a config key, model.moe.<name> (config/schema.py builds the schema from it)
    num_experts: int = setting(8, ge=1)
    top_k: int = setting(2, ge=1)  # experts per token (<= num_experts: validate)
    hidden_dim: int = setting(64, ge=1)  # each expert's SwiGLU width (HF ``moe_intermediate_size``)
    norm_topk_prob: bool = setting(True)  # renormalise the k selected scores to sum to 1
    score_func: str = setting("softmax", choices=SCORE_FUNCS)  # softmax (Qwen) or sigmoid (DeepSeek-V3)
    route_scale: float = setting(1.0, gt=0)  # multiplies the routing weights (DeepSeek-V3's routed_scaling_factor)
    num_shared_experts: int = setting(0, ge=0)  # always-on experts (DeepSeek-V3), one SwiGLU of num_shared * hidden_dim
    aux_loss: str = setting("pooled", choices=AUX_LOSSES)
    aux_loss_coef: float = setting(0.0, ge=0)
    # global loss: count each micro-batch's tokens (micro_batch), or the whole optimizer step's, taken by a
    # no-grad forward over the step's micro-batches before the first backward (step: exact under accumulation)
    aux_loss_counts: str = setting("micro_batch", choices=AUX_LOSS_COUNTS)
    bias_update_rate: float = setting(0.0, ge=0)  # > 0: auxiliary-loss-free balancing with this step size
    experts_impl: str = setting("auto", choices=EXPERT_IMPLS)  # auto: grouped GEMM where it works, else the loop

    def validate(self) -> None:
        """One ``key=value: what is wrong; what to do`` line per problem (the config prints it as is)."""
        if self.num_experts < 1:
            raise ValueError(f"model.moe.num_experts={self.num_experts}: no experts; use model.moe.num_experts>=1")
        if self.top_k < 1:
            raise ValueError(f"model.moe.top_k={self.top_k}: a token must reach an expert; use model.moe.top_k>=1")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k}: more than model.moe.num_experts={self.num_experts} (a token "
                f"picks top_k distinct experts); lower model.moe.top_k or raise model.moe.num_experts"
            )
        for key, value, choices in (
            ("score_func", self.score_func, SCORE_FUNCS),
            ("aux_loss", self.aux_loss, AUX_LOSSES),
            ("experts_impl", self.experts_impl, EXPERT_IMPLS),
            ("aux_loss_counts", self.aux_loss_counts, AUX_LOSS_COUNTS),
        ):
            if value not in choices:
                raise ValueError(f"model.moe.{key}={value}: not an option; choose one of {', '.join(choices)}")
        if self.bias_update_rate < 0:
            raise ValueError(
                f"model.moe.bias_update_rate={self.bias_update_rate}: negative; use 0 (off) or a positive step size"
            )
        if self.aux_loss_counts == "step" and (self.aux_loss != "global" or self.aux_loss_coef == 0):
            raise ValueError(
                f"model.moe.aux_loss_counts=step: only the global-batch loss counts tokens over the step (aux_loss="
                f"{self.aux_loss}, aux_loss_coef={self.aux_loss_coef}); set model.moe.aux_loss=global with "
                f"aux_loss_coef>0, or aux_loss_counts=micro_batch"
            )
        if self.norm_topk_prob and self.top_k == 1 and self.score_func == "softmax" and self.aux_loss_coef == 0:
            # every routing weight would be exactly 1: the router gets no gradient at all and never learns
            raise ValueError(
                "model.moe.norm_topk_prob=true: with top_k=1, softmax scores and no auxiliary loss every "
                "routing weight is 1 and the router never learns; set model.moe.norm_topk_prob=false, "
                "top_k>1 or aux_loss_coef>0"
            )

    @property
    def has_aux_loss(self) -> bool:
        return self.aux_loss != "none" and self.aux_loss_coef > 0

    @property
    def counts_whole_step(self) -> bool:
        """The global-batch loss counts the whole optimizer step's tokens (``count_step_tokens`` first)."""
        return self.aux_loss_counts == "step" and self.has_aux_loss


def stable_topk(scores: Tensor, k: int) -> Tensor:
    """Indices [N, k] of the k largest scores per row; equal scores go to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class Router(nn.Module):
    """Scores every expert per token and picks ``top_k``; returns (scores, weights, indices).

    ``scores`` [N, E] are the full (fp32+) probabilities the auxiliary losses need; ``weights``
    [N, k] the selected ones (renormalised, scaled); ``indices`` [N, k].
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(_at_least_fp32(x), _at_least_fp32(self.gate.weight))
        scores = logits.softmax(-1) if self.args.score_func == "softmax" else logits.sigmoid()
        choose = scores if expert_bias is None else scores.detach() + expert_bias.to(scores.dtype)
        indices = stable_topk(choose, self.args.top_k)
        weights = scores.gather(-1, indices)
        if self.args.norm_topk_prob:
            # sigmoid scores can all be tiny; the epsilon keeps the division finite (DeepSeek-V3 does the same)
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.args.score_func == "sigmoid" else 0))
        return scores, weights * self.args.route_scale, indices


@torch.compiler.assume_constant_result  # compile reads the answer while tracing instead of tracing the probe
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for this device type and dtype (probed once)."""
    return _probe_grouped_mm(device_type, dtype)


@torch.compiler.assume_constant_result
def grouped_mm_traces(dtype: torch.dtype) -> bool:
    """Whether compile can trace ``torch._grouped_mm`` for this dtype: it runs the meta kernel on fake tensors,
    which may refuse a dtype that eager runs (torch 2.14 on CPU: fp32 runs eagerly, its meta kernel wants bf16)."""
    return _probe_grouped_mm_meta(dtype)


@functools.cache
def _probe_grouped_mm_meta(dtype: torch.dtype) -> bool:
    try:
        x, w = torch.zeros(4, 16, device="meta", dtype=dtype), torch.zeros(2, 16, 16, device="meta", dtype=dtype)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.zeros(2, device="meta", dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


@functools.cache
def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """The probe runs in a thread of its own: the first call comes from inside a forward, where activation
    checkpointing's saved-tensor hooks and dispatch modes (thread-local) would record the probe's tensors as
    the block's. The recomputed forward, which no longer probes, then saved 3 tensors fewer and
    ``torch.utils.checkpoint`` raised."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # a new thread starts on CUDA device 0: probe on the caller's device
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_grouped_mm_runs, device, dtype).result()


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.zeros(4, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.zeros(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        # not out.sum().backward(): CPU's grouped_mm backward refuses that gradient's zero strides, which made
        # the probe answer False everywhere (the loop ran instead)
        out.backward(torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(*sizes: int, dtype: torch.dtype) -> bool:
    """grouped_mm wants every row stride a multiple of 16 bytes."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return all((s * itemsize) % 16 == 0 for s in sizes)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; input tokens already sorted by expert, ``counts`` per expert."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, impl: str = "auto") -> None:
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def use_grouped(self, x: Tensor) -> bool:
        if self.impl == "loop":
            return False
        ok = grouped_mm_works(x.device.type, x.dtype) and _aligned(self.w1.shape[-1], self.w1.shape[-2], dtype=x.dtype)
        ok = ok and (not torch.compiler.is_compiling() or grouped_mm_traces(x.dtype))
        if self.impl == "grouped" and not ok:
            raise RuntimeError(
                f"model.moe.experts_impl=grouped: torch._grouped_mm does not run for {x.dtype} on "
                f"{x.device.type} at these sizes; use experts_impl=auto or loop"
            )
        return ok

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        # isinstance, not hasattr(w, "to_local"): compile reads hasattr of a DTensor parameter as False
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        if self.use_grouped(x):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
                x, w3.transpose(-2, -1), offs=offs
            )
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            outs.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
            start += n
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class SwiGLU(nn.Module):
    """A dense SwiGLU (shared experts, and the dense layers of MoE families): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """x [b, s, dim] -> [b, s, dim]; leaves this forward's balancing statistics in ``self.stats``.

    ``stats``: ``counts`` [E] (assignments, no grad), ``prob_sum`` [E] (sum of scores over tokens,
    with grad), ``rows`` (tokens) and, for the sequence-wise loss, ``seq_loss`` (this layer's loss,
    mean over sequences). ``moe_aux_loss`` turns the stats of all layers into the loss.
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, args.experts_impl)
        self.shared_experts = (
            SwiGLU(dim, args.hidden_dim * args.num_shared_experts) if args.num_shared_experts else None
        )
        # Aux-loss-free balancing: persistent (checkpointed with the weights); counts are per step.
        self.register_buffer(
            "expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=args.bias_update_rate > 0
        )
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)
        # The group the global-batch loss sums its counts over (data x context ranks); None: this process.
        self.count_group: dist.ProcessGroup | None = None
        # The context-parallel ranks holding the other parts of this rank's sequences (the sequence-wise loss
        # sums its per-sequence statistics over them); None: this rank holds whole sequences.
        self.cp_group: dist.ProcessGroup | None = None
        self.stats: dict[str, Tensor | int] = {}
        # MoE layers in the whole model (set by the model): a layer's share of the mean over layers.
        self.num_moe_layers = 1
        # The detached shares this layer back-propagated itself (``losses_in_backward``) and their forwards.
        # Buffers, updated in place: torch's pipeline stage (2.15) runs a probe forward and backward before the
        # first micro-batch and restores every buffer afterwards, so the probe leaves nothing here.
        # float64: the logged loss of a float64 run keeps its precision (one scalar; nothing trains on it)
        self.register_buffer("injected_aux", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("injected_forwards", torch.zeros((), dtype=torch.float32), persistent=False)
        # ``aux_loss_counts=step`` (``count_step_tokens``): while ``counting`` is set, forwards only add their
        # tokens per expert (and, last, their tokens) to it; ``step_counts``, the step's totals over
        # ``count_group``, then replace each micro-batch's own in the global-batch loss until cleared.
        # (a buffer while set: torch's pipeline stage restores buffers after its metadata probe's forward)
        self.register_buffer("counting", None, persistent=False)
        self.step_counts: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        bs, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        bias = self.expert_bias if self.args.bias_update_rate > 0 else None
        scores, weights, indices = self.router(flat, bias)
        flat_idx = indices.reshape(-1)
        counts = torch.bincount(flat_idx, minlength=self.args.num_experts)
        self._record(scores, indices, counts, bs, seqlen)
        order = torch.argsort(flat_idx, stable=True)  # tokens grouped by expert, in token order within one
        token_of = order // self.args.top_k
        out = self.run_experts(flat[token_of], counts, weights.reshape(-1)[order, None])
        y = torch.zeros_like(flat).index_add_(0, token_of, out.to(flat.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        scale = backward_scale()
        if scale is not None and self.stats:
            y = self._inject_aux_loss(y, scale)
        return y.view(bs, seqlen, dim)

    def _inject_aux_loss(self, y: Tensor, scale: float) -> Tensor:
        """Back-propagate this layer's share of the auxiliary loss from here (times ``scale``), not from the
        model's loss; keep its detached value for the log. The statistics are consumed: ``moe_aux_loss``
        then finds none, so the last stage does not add the share a second time."""
        if self.args.aux_loss == "pooled":
            raise RuntimeError(
                "model.moe.aux_loss=pooled: a product of sums over every MoE layer, which a layer cannot "
                "back-propagate alone (pipeline stages); use model.moe.aux_loss=global or sequence"
            )
        share = self.args.aux_loss_coef * layer_aux_loss(self) / self.num_moe_layers
        self.stats = {}
        # once per forward: a forward recomputed by activation checkpointing runs inside backward
        if torch._C._current_graph_task_id() == -1:
            self.injected_aux += share.detach().to(self.injected_aux.dtype)
            self.injected_forwards += 1
        return add_to_backward(y, share, scale)

    def run_experts(self, x: Tensor, counts: Tensor, weights: Tensor) -> Tensor:
        """Tokens sorted by expert -> their outputs times their routing ``weights`` [n, 1], in the same order;
        expert parallel replaces this (under tp it splits the tokens and weights over the tp ranks)."""
        out = self.experts(x, counts)
        return out * weights.to(out.dtype)

    def _record(self, scores: Tensor, indices: Tensor, counts: Tensor, bs: int, seqlen: int) -> None:
        counts_f = counts.detach().to(torch.promote_types(scores.dtype, torch.float32))  # float64 in a float64 run
        if self.counting is not None:  # the step's counting forward: nothing else (no bias counts, no stats)
            self.counting += torch.cat([counts_f, counts_f.new_full((1,), bs * seqlen)])
            self.stats = {}
            return
        self.last_counts = counts_f  # the last forward's tokens per expert (observe/expert_load.py logs them)
        # A forward that activation checkpointing recomputes inside backward makes the loss terms again (it
        # must save the tensors the forward saved) but takes no counts, runs no collective and keeps the
        # forward's statistics: those were taken once, by the forward.
        # (compiled, a block's recomputation happens inside the compiled backward, never in this Python)
        recomputed = not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
        if self.training and self.args.bias_update_rate > 0 and not recomputed:
            self.tokens_per_expert += counts_f
        aux = self.args.aux_loss if self.args.aux_loss_coef > 0 else "none"
        if aux == "none" or not torch.is_grad_enabled():
            if not recomputed:
                self.stats = {}
            return
        if aux == "sequence":
            # a recomputed forward runs the cp sum again (every cp rank recomputes the same blocks in order)
            seq_loss = sequence_aux_loss(scores.view(bs, seqlen, -1), indices.view(bs, seqlen, -1), self.cp_group)
            stats = {"seq_loss": seq_loss}
        else:
            stats = {"counts": counts_f.to(scores.dtype), "prob_sum": scores.sum(0), "rows": bs * seqlen}
        if recomputed:
            return
        if aux == "global" and self.step_counts is not None:  # the whole step's, taken before its first forward
            stats["global_counts"] = self.step_counts[:-1].to(scores.dtype)
            stats["global_rows"] = self.step_counts[-1].to(scores.dtype)
        elif aux == "global" and self.count_group is not None:
            rows = torch.tensor([float(bs * seqlen)], dtype=scores.dtype, device=scores.device)
            both = torch.cat([stats["counts"], rows])
            dist.all_reduce(both, group=self.count_group)
            stats["global_counts"], stats["global_rows"] = both[:-1], both[-1]
        self.stats = stats


def sequence_aux_loss(scores: Tensor, indices: Tensor, cp_group: dist.ProcessGroup | None = None) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without alpha), mean over sequences.

    scores [b, s, E], indices [b, s, k]: f_i = E / (k s) * tokens of the sequence routed to i,
    P_i = mean over the sequence of the scores normalised to sum 1; loss = sum_i f_i P_i.
    ``cp_group``: the context-parallel ranks holding the rest of these ``b`` sequences (every rank the same
    number of tokens); per sequence the counts and score sums are summed over them, so every cp rank has
    the whole sequences' loss. The score sums go through an all-reduce with autograd (its backward sums
    the gradients over the ranks), so each rank's router gets the gradient of its own tokens' scores.
    """
    b, s, num_experts = scores.shape
    k = indices.shape[-1]
    counts = torch.zeros(b, num_experts, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, indices.reshape(b, -1), torch.ones(b, s * k, dtype=scores.dtype, device=scores.device))
    normalised = scores / scores.sum(-1, keepdim=True)
    if cp_group is None:
        p = normalised.mean(1)
    else:
        dist.all_reduce(counts, group=cp_group)
        s = s * dist.get_world_size(cp_group)
        p = _SumOverRanks.apply(normalised.sum(1), cp_group) / s
    f = counts * num_experts / (k * s)
    return (f * p).sum(-1).mean()


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward sums the gradients over the same ranks. Written here because
    ``torch.distributed.nn.functional.all_reduce`` is deprecated and functional collectives' ``all_reduce``
    carries autograd only in recent torch releases (this must run on older ones too)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def count_step_tokens(
    model: nn.Module, forwards: Iterable[Callable[[], object]], group: dist.ProcessGroup | None = None
) -> None:
    """Take the whole optimizer step's tokens per expert before its first backward (``aux_loss_counts=step``).

    Why a forward: a layer's routing depends on every layer before it, so only the step's own forwards give
    its counts. ``forwards`` run the step's micro-batches (the same inputs, weights and expert bias as the
    training forwards that follow, so the same routing) without autograd and with the RNG state restored
    afterwards; the layers only count in them (no expert-bias counts, no loss statistics). The counts are
    summed over ``group`` (the ranks sharing the global batch) in one all-reduce, and the global-batch loss
    of every following forward uses them until ``forget_step_counts``. Then each micro-batch's loss is
    ``E * sum_e (step counts_e / step tokens) * mean_prob_e`` over its own tokens, and the mean over the
    micro-batches and ranks (accumulation's and the gradient reduction's) is one process's on the whole batch.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.args.counts_whole_step]
    for m in layers:
        m.step_counts, m.counting = None, m.tokens_per_expert.new_zeros(m.args.num_experts + 1)
    device = next(model.parameters()).device
    try:
        # the forwards run even without such layers here: a pipeline stage without MoE layers takes its part
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for forward in forwards:
                forward()
    finally:
        counts = [m.counting for m in layers]
        for m in layers:
            m.counting = None
    if not layers:
        return
    counts = torch.stack(counts)
    if group is not None:  # the same stage's layers on every rank of the group
        dist.all_reduce(counts, group=group)
    for m, row in zip(layers, counts):
        m.step_counts = row


def forget_step_counts(model: nn.Module) -> None:
    """The step's forwards are done: the next step counts again."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.step_counts = None


def layer_aux_loss(m: MoE) -> Tensor:
    """One layer's loss (no coefficient) from its last forward's statistics, for the per-layer kinds.

    global: E * sum_e (global counts / global rows) * (prob_sum / rows); sequence: the layer's sequence-wise loss.
    """
    if m.args.aux_loss == "sequence":
        return m.stats["seq_loss"]
    counts = m.stats.get("global_counts", m.stats["counts"])
    rows = m.stats.get("global_rows", m.stats["rows"])
    return m.args.num_experts * ((counts / rows) * (m.stats["prob_sum"] / m.stats["rows"])).sum()


def moe_aux_loss(layers: list[MoE]) -> Tensor | None:
    """The auxiliary loss (times its coefficient) from the last forward of ``layers``; None if there is none.

    pooled: E * sum_e (sum_l counts / sum_l rows) * (sum_l prob_sum / sum_l rows), as transformers;
    global: mean over layers of E * sum_e (global counts / global rows) * (prob_sum / rows);
    sequence: mean over layers of each layer's sequence-wise loss.
    """
    active = [m for m in layers if m.stats]
    if not active:
        return None
    args = active[0].args
    if args.aux_loss == "pooled":
        rows = sum(m.stats["rows"] for m in active)
        counts = torch.stack([m.stats["counts"] for m in active]).sum(0)
        probs = torch.stack([m.stats["prob_sum"] for m in active]).sum(0)
        loss = args.num_experts * ((counts / rows) * (probs / rows)).sum()
    else:
        loss = torch.stack([layer_aux_loss(m) for m in active]).mean()
    return args.aux_loss_coef * loss


def take_injected_aux_loss(model: nn.Module, device: torch.device) -> Tensor:
    """This rank's part of the auxiliary loss its layers back-propagated themselves since the last call: the
    sum over its MoE layers of each one's mean share over its forwards (zero without any), for the log. The
    stages' parts sum (over the pipeline group) to the loss ``moe_aux_loss`` gives one forward of the model."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for m in model.modules():
        if isinstance(m, MoE):  # a layer without forwards adds 0 / 1 (no host sync to ask)
            total = total + (m.injected_aux / m.injected_forwards.clamp(min=1)).to(device)
            m.injected_aux.zero_()
            m.injected_forwards.zero_()
    # float32, float64 in a float64 run: as the logged loss. From any parameter: the stages of a rank may hold no
    # MoE layer, and every stage must pick the same dtype for the sum over them.
    return total.to(torch.promote_types(next(model.parameters()).dtype, torch.float32))


def take_aux_term(model: nn.Module) -> Tensor | None:
    """The auxiliary loss the model's last forward added to its returned loss (live), once; None without one.

    Why apart: the loss is normalised per valid target, the auxiliary loss per micro-batch."""
    term = getattr(model, "last_aux_term", None)
    if term is not None:
        model.last_aux_term = None
    return term


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """DeepSeek-V3's aux-loss-free step: bias += rate * sign(mean count - count), then reset the counts.

    Call after the optimizer step. ``group``: the ranks that saw other parts of the same global
    batch (data x context); their counts are summed first, so every rank moves the bias alike.
    """
    for m in model.modules():
        if not isinstance(m, MoE) or m.args.bias_update_rate <= 0:
            continue
        counts = m.tokens_per_expert
        if group is not None:
            dist.all_reduce(counts, group=group)
        m.expert_bias += m.args.bias_update_rate * torch.sign(counts.mean() - counts)
        counts.zero_()


def _at_least_fp32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()
