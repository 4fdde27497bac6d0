"""The written contract between module, strategy and callbacks, and the one place a plan is looked up.

One process, no process group, no fit: the strategy's own lookups (``plan_for``, ``resolve_dims``) on
a meta model, and the source read statically for probes (``getattr``/``hasattr`` naming a member).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import lit_titan
from lit_titan.models import registry
from lit_titan.models.llama3 import Transformer
from lit_titan.module import PretrainModule
from lit_titan.strategies import ParallelPlan, TitanStrategy, parallel_plan
from lit_titan.strategies.contract import (
    ModuleContract,
    PlainModule,
    SequenceData,
    StrategyContract,
    module_contract,
)
from lit_titan.strategies.parallel_dims import LayoutError

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}


def _meta_llama(cls: type = Transformer) -> nn.Module:
    with torch.device("meta"):
        return cls(registry.model_args("llama3_debug", **TINY))


def test_the_plan_comes_from_the_family_spec_or_the_strategy_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    stock = registry.family("llama3")
    assert TitanStrategy().plan_for(_meta_llama()) is stock.plan

    class MyLlama(Transformer):  # a user's subclass of a family's model keeps the family's plan
        pass

    assert TitanStrategy().plan_for(_meta_llama(MyLlama)) is stock.plan
    # One registry: the family's entry in FAMILIES is what the strategy (and the planner) use, so
    # replacing it changes the plan, and putting it back restores the stock one.
    changed = replace(stock, plan=replace(stock.plan, block_container="blocks"))
    with monkeypatch.context() as patch:
        patch.setitem(registry.FAMILIES, "llama3", lambda: changed)
        assert TitanStrategy().plan_for(_meta_llama()).block_container == "blocks"
    assert TitanStrategy().plan_for(_meta_llama()) is stock.plan

    # A model of no family: the strategy's plan= argument, else one line naming it.
    own = ParallelPlan(tp_root=lambda m, lp: {}, tp_block=lambda b: {}, blocks=lambda m: [], fsdp_units=lambda m: [])
    assert TitanStrategy(plan=own).plan_for(nn.Linear(2, 2)) is own
    with pytest.raises(TypeError, match=r"Linear is not the model of a registered family.*TitanStrategy\(plan="):
        TitanStrategy().plan_for(nn.Linear(2, 2))
    assert not {"register_plan", "plan_for", "_REGISTRY"} & set(vars(parallel_plan))


def _members(interface: type) -> set[str]:
    return {n for n in (*interface.__annotations__, *vars(interface)) if not n.startswith("_")}


def _answered(implementation: object, member: str) -> bool:
    if member in vars(implementation):
        return True
    owner = next((c for c in type(implementation).__mro__ if member in vars(c)), None)
    return owner is not None and owner is not ModuleContract


def test_the_module_contract_is_written_and_kept() -> None:
    module = PretrainModule(model="llama3_debug", model_overrides=TINY)
    plain = module_contract(L.LightningModule())
    assert module_contract(module) is module and isinstance(plain, PlainModule)
    members = _members(ModuleContract)
    assert {"model_args", "seed", "tokens_per_step", "step_mean_loss", "last_grad_norm", "build_model"} <= members
    for implementation in (module, plain):  # every member answered by the instance or its class, no stub
        missing = [m for m in sorted(members) if not _answered(implementation, m)]
        assert not missing, (type(implementation).__name__, missing)
    assert module.model_args.n_heads == 4 and module.step_mean_loss is None and module.tokens_per_step == 0
    assert plain.model is None and plain.model_args is None and plain.step_mean_loss is None


def test_the_layout_is_checked_through_the_contract(tmp_path: Path) -> None:
    """``resolve_dims`` holds the degrees against the module's model args and the data's seq_len."""

    class Data(L.LightningDataModule):
        seq_len = 30

    def resolve(module: L.LightningModule, tp: int) -> None:
        strategy = TitanStrategy(tp=tp)
        trainer = L.Trainer(accelerator="cpu", devices=tp, strategy=strategy, logger=False, default_root_dir=tmp_path)
        trainer.datamodule = Data()
        strategy._lightning_module = module
        module.trainer = trainer
        strategy.resolve_dims()

    assert isinstance(Data(), SequenceData)
    module = PretrainModule(model="llama3_debug", model_overrides=TINY)  # 4 heads, 2 kv heads
    with pytest.raises(LayoutError, match=r"n_kv_heads=2"):
        resolve(module, 4)
    with pytest.raises(LayoutError, match=r"data.seq_len=30: not divisible by tp=4"):
        resolve(PretrainModule(model="llama3_debug", model_overrides={**TINY, "n_kv_heads": 4}), 4)
    resolve(module, 2)  # 2 divides both the heads and seq_len 30


def _contract_probes(members: set[str]) -> list[str]:
    root = Path(lit_titan.__file__).parent
    probes = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in members
            ):
                probes.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return probes


def test_no_getattr_probes_stand_for_the_contract() -> None:
    """Nowhere in lit_titan (strategies/ included) is a member of a contract, or the private attribute
    behind one, probed with getattr/hasattr: callers go through contract() / module_contract()."""
    members = _members(StrategyContract) | _members(ModuleContract) | _members(SequenceData)
    private = {"_tokens_per_step", "_step_loss", "_micro_batches", "_last_grad_norm", "_owns_process_group"}
    private |= {"train_batches"}  # PretrainDataModule's, read by the DataProgress callback
    assert not _contract_probes(members | private)
    assert "model_args" in inspect.getsource(TitanStrategy.resolve_dims)  # still checked, through the contract
