"""The model families lit-titan trains: a family is one ``ModelSpec`` in ``FAMILIES``.

Everything outside ``models/`` (the module, config, planner, export, callbacks) reaches a model through
this file: a flavor name (``model=...``, the ``name`` of ``conf/model/*.yaml``) finds its family, and
the family says how to build, parallelise, count and convert it. A new family is a package
``models/<family>/`` plus one line in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lit_titan.strategies.parallel_plan import ParallelPlan


class ModelArgsLike(Protocol):
    """What code outside ``models/`` may read from a family's (frozen dataclass) arguments: the shapes
    that config rules, the parallel layout's divisibility checks and the data pipeline depend on."""

    vocab_size: int
    n_layers: int  # repeated blocks; the pipeline splits n_layers + 2 units (embedding and head count)
    n_heads: int
    max_seq_len: int
    tie_embeddings: bool

    @property
    def kv_heads(self) -> int: ...

    def with_overrides(self, **overrides: Any) -> ModelArgsLike: ...


class HFAdapter(Protocol):
    """A family's Hugging Face conversion (names, layout changes, ``config.json``); files: ``hf_io``."""

    def check_hf_expressible(self, args: Any, where: str) -> None: ...
    def check_hf_dir(self, path: str, args: Any) -> None: ...
    def load_hf_weights(self, model: nn.Module, path: str) -> None: ...
    def param_shapes(self, args: Any) -> dict[str, tuple[int, ...]]: ...
    def iter_hf_tensors(
        self, state_dict: dict[str, Tensor], args: Any, dtype: torch.dtype
    ) -> Iterator[tuple[str, Tensor]]: ...
    def hf_config(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]: ...
    # one line each, or None: state the HF format cannot hold, left out of an export / reset by init_from_hf
    def export_note(self, args: Any) -> str | None: ...
    def import_note(self, args: Any) -> str | None: ...


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args: type  # frozen dataclass of hyper-parameters (ModelArgsLike)
    model: Callable[[Any], nn.Module]  # args -> the nn.Module, no parallel code (built on meta)
    flavors: Mapping[str, Any]  # flavor name -> args
    get_flavor: Callable[..., Any]  # (name, **overrides) -> validated args; ValueError naming the fix
    plan: ParallelPlan  # TP styles, blocks, FSDP / pipeline units (strategies/parallel_plan.py)
    hf: HFAdapter | None  # None: no Hugging Face counterpart (export and init_from_hf refuse it)
    # (args, active=False): whole model, analytic; active=True: what one token computes with (MoE: the
    # router, top_k experts and shared ones; a dense family's active count is its whole count)
    count_params: Callable[..., int]
    # (args, seq_len, num_params=None): training model FLOPs per token, on ACTIVE parameters; num_params
    # is the whole model's count when measured on a built model, which a dense family uses and an MoE
    # family ignores (a token does not touch every expert)
    flops_per_token: Callable[..., float]
    # (args, layer) -> (elements TP shards, elements TP keeps whole) of block ``layer``: the planner's
    # closed-form layout (planner/analytic.py), which must agree with the family's parallel plan
    layer_numel: Callable[[Any, int], tuple[int, int]] | None = None
    # model.* keys whose null is a value (e.g. no rotary scaling), passed even when null
    nullable_keys: tuple[str, ...] = ()

    @property
    def arg_keys(self) -> tuple[str, ...]:
        """The ``model.*`` config keys that override the flavor's arguments."""
        return tuple(f.name for f in fields(self.args))


def _llama3() -> ModelSpec:
    from lit_titan.models import llama3
    from lit_titan.models.llama3 import flops, hf
    from lit_titan.models.llama3.parallelize import LLAMA3_PLAN

    return ModelSpec(
        name="llama3",
        args=llama3.ModelArgs,
        model=llama3.Transformer,
        flavors=llama3.FLAVORS,
        get_flavor=llama3.get_flavor,
        plan=LLAMA3_PLAN,
        hf=hf,
        count_params=flops.count_params,
        flops_per_token=flops.flops_per_token,
        layer_numel=flops.layer_numel,
        nullable_keys=("rope_scaling",),
    )


def _qwen3_moe() -> ModelSpec:
    from lit_titan.models import qwen3_moe
    from lit_titan.models.qwen3_moe import hf
    from lit_titan.models.qwen3_moe.parallelize import QWEN3_MOE_PLAN

    return ModelSpec(
        name="qwen3_moe",
        args=qwen3_moe.Qwen3MoEArgs,
        model=qwen3_moe.Qwen3MoE,
        flavors=qwen3_moe.FLAVORS,
        get_flavor=qwen3_moe.get_flavor,
        plan=QWEN3_MOE_PLAN,
        hf=hf,
        count_params=qwen3_moe.count_params,
        flops_per_token=qwen3_moe.flops_per_token,
        layer_numel=qwen3_moe.layer_numel,
    )


# family name -> how to build its spec (imported on first use, so `import lit_titan.models.registry` stays light)
FAMILIES: dict[str, Callable[[], ModelSpec]] = {
    "llama3": _llama3,
    "qwen3_moe": _qwen3_moe,
}

# Keyed by the entry, not the name: replacing a family's entry in FAMILIES (a changed plan) takes effect.
_specs: dict[Callable[[], ModelSpec], ModelSpec] = {}


def family(name: str) -> ModelSpec:
    make = FAMILIES[name]
    if make not in _specs:
        _specs[make] = make()
    return _specs[make]


def families() -> list[ModelSpec]:
    return [family(name) for name in FAMILIES]


def flavor_names() -> list[str]:
    return sorted(f for spec in families() for f in spec.flavors)


def spec_for(flavor: str) -> ModelSpec:
    """The family of a flavor name; unknown names fail with the list of valid ones."""
    for spec in families():
        if flavor in spec.flavors:
            return spec
    raise ValueError(f"unknown model flavor {flavor!r}; choose model=<one of {flavor_names()}>")


def args_class(flavor: str) -> type | None:
    """The arguments dataclass of a flavor's family (the config schema of its ``model`` group); None: unknown."""
    for spec in families():
        if flavor in spec.flavors:
            return spec.args
    return None


def spec_of(args: Any) -> ModelSpec:
    """The family whose arguments ``args`` are (its own class first, then a subclass of one)."""
    for match in (lambda spec: type(args) is spec.args, lambda spec: isinstance(args, spec.args)):
        for spec in families():
            if match(spec):
                return spec
    raise TypeError(
        f"{type(args).__name__} is not the arguments of a registered model family "
        f"({', '.join(FAMILIES)}); add the family to lit_titan.models.registry.FAMILIES"
    )


def spec_of_model(model: nn.Module) -> ModelSpec:
    """The family whose model class built ``model`` (its own class first, then a subclass of one).

    How ``TitanStrategy`` finds a model's ``ParallelPlan``; a model of no family gets its plan from
    ``TitanStrategy(plan=...)``.
    """
    for match in (lambda cls: type(model) is cls, lambda cls: isinstance(model, cls)):
        for spec in families():
            if isinstance(spec.model, type) and match(spec.model):
                return spec
    raise TypeError(
        f"{type(model).__name__} is not the model of a registered family ({', '.join(FAMILIES)}); pass its "
        f"layout as TitanStrategy(plan=ParallelPlan(...)), or add its family to lit_titan.models.registry.FAMILIES"
    )


def model_args(flavor: str, **overrides: Any) -> Any:
    """A flavor's validated arguments with ``model.*`` overrides applied."""
    return spec_for(flavor).get_flavor(flavor, **overrides)


def build_model(args: Any) -> nn.Module:
    return spec_of(args).model(args)


def count_params(args: Any, active: bool = False) -> int:
    """Whole-model parameters (memory), or with ``active`` those one token computes with (FLOPs)."""
    spec = spec_of(args)
    return spec.count_params(args, active=True) if active else spec.count_params(args)


def flops_per_token(args: Any, seq_len: int, num_params: int | None = None) -> float:
    return spec_of(args).flops_per_token(args, seq_len, num_params)


def layer_numel(args: Any, layer: int) -> tuple[int, int]:
    """(elements TP shards, elements TP keeps whole) of block ``layer``; TypeError when the family has no count."""
    spec = spec_of(args)
    if spec.layer_numel is None:
        raise TypeError(f"the {spec.name} model family has no layer_numel; the planner cannot size it")
    return spec.layer_numel(args, layer)


def num_experts(args: Any) -> int | None:
    """Routed experts per MoE layer (what ``parallel.ep`` splits), None for a dense model."""
    moe = getattr(args, "moe", None)
    return getattr(moe, "num_experts", None)


def hf_adapter(args: Any, where: str) -> HFAdapter:
    """The family's Hugging Face adapter; ValueError when the family has none."""
    spec = spec_of(args)
    if spec.hf is None:
        raise ValueError(f"{where}: the {spec.name} model family has no Hugging Face counterpart")
    return spec.hf
