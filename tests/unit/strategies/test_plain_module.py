"""A plain LightningModule (not a ``PretrainModule``) under TitanStrategy, as Lightning's own strategy trains it:
its ``configure_model`` parallelises over ``device_mesh["data_parallel"]`` / ``["tensor_parallel"]``, its own hooks
run, and at dp2 and tp2 it trains equal to one process in float64 (gradients before clipping, weights after each
step, the logged losses); validate, predict and save_checkpoint on the same Trainer after fit."""

from __future__ import annotations

import pytest
import torch

# float64: the layouts differ from one process by summation order only
TOL = 1e-10
# Lightning's advice for trainer.validate under several processes (the user's choice here, not a fault)
VALIDATE_ADVICE = ("Using `DistributedSampler` with the dataloaders",)


@pytest.fixture(scope="module")
def reference(worlds, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "one.pt"
    worlds.run(1, "scripts.plain_module:main", str(out), 1)
    return torch.load(out, weights_only=True)


def _worst(got: dict, ref: dict, kinds: tuple[str, ...] = ("grads", "params")) -> tuple[float, str]:
    worst = (0.0, "")
    for kind in kinds:
        assert len(got[kind]) == len(ref[kind]) == 3, (kind, len(got[kind]))
        for step, (g, r) in enumerate(zip(got[kind], ref[kind])):
            assert sorted(g) == sorted(r), (kind, sorted(set(g) ^ set(r)))
            for name, t in r.items():
                err = (g[name] - t).abs().max().item() / max(t.abs().max().item(), 1e-30)
                worst = max(worst, (err, f"{kind} step {step} {name}"))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_a_plain_module_trains_equal_to_one_process(tp, reference, worlds, tmp_path):
    out = tmp_path / "got.pt"
    worlds.run(2, "scripts.plain_module:main", str(out), tp, allow_noise=VALIDATE_ADVICE)
    got = torch.load(out, weights_only=True)
    assert got["mesh"] == ("data_parallel", "tensor_parallel")
    err, where = _worst(got, reference)
    print(f"plain module at {'tp2' if tp == 2 else 'dp2'}: worst {err:.3g} ({where})")
    assert err < TOL, (err, where)
    # the reference learns and Lightning's clipping engages (norms above gradient_clip_val=0.5)
    norms = [torch.cat([g.flatten() for g in step.values()]).norm().item() for step in reference["grads"]]
    assert min(norms) > 0.5, norms
    for key in ("train_loss", "val_loss", "test_loss"):
        assert got[key] == pytest.approx(reference[key], rel=TOL), key
    assert got["test_loss"] == pytest.approx(got["val_loss"], rel=TOL)  # the same rows and weights
    rows = reference["predicted"] if tp == 2 else reference["predicted"][0::2]  # dp2: rank 0's rows
    assert torch.equal(got["predicted"], rows)
    assert got["saved"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_a_plain_module_parallelised_by_a_plan_trains_equal_to_one_process(tp, reference, worlds, tmp_path):
    """``TitanStrategy(plan=...)``: the strategy applies the module's TP styles and FSDP units to its ``model``."""
    out = tmp_path / "planned.pt"
    worlds.run(2, "scripts.plain_module:main", str(out), tp, False, False, True, allow_noise=VALIDATE_ADVICE)
    got = torch.load(out, weights_only=True)
    err, where = _worst(got, reference)
    assert err < TOL, (err, where)
    assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=TOL)


@pytest.mark.slow
def test_manual_optimisation_of_a_plain_module_at_tp2_equals_automatic_in_one_process(reference, worlds, tmp_path):
    """zero_grad, manual_backward, clip_gradients and step by hand: the weights after each step are the automatic
    reference's."""
    out = tmp_path / "manual.pt"
    worlds.run(2, "scripts.plain_module:main", str(out), 2, False, True, allow_noise=VALIDATE_ADVICE)
    got = torch.load(out, weights_only=True)
    err, where = _worst(got, reference, kinds=("params",))
    assert err < TOL, (err, where)
    assert got["train_loss"] == pytest.approx(reference["train_loss"], rel=TOL)


@pytest.mark.slow
def test_a_plain_module_mutant_trains_every_rank_on_the_same_rows(reference, worlds, tmp_path):
    """The check can fail: sampler arguments that tell each rank it is the only replica (each trains rows 0-1)."""
    out = tmp_path / "mutant.pt"
    worlds.run(2, "scripts.plain_module:main", str(out), 1, True, allow_noise=VALIDATE_ADVICE)
    err, where = _worst(torch.load(out, weights_only=True), reference)
    print(f"plain module, sampler mutant: {err:.3g} ({where}), {err / TOL:.3g}x the tolerance")
    assert err > 1e3 * TOL, (err, where)


def test_pipeline_or_context_parallel_for_a_plain_module_is_refused_in_one_line():
    import lightning as L

    from lit_titan import TitanStrategy
    from lit_titan.strategies.parallel_dims import LayoutError, ParallelDims

    strategy = TitanStrategy(pp=2)
    strategy._lightning_module = L.LightningModule()
    with pytest.raises(LayoutError) as info:
        strategy._check_plain_layout(ParallelDims.resolve(4, pp=2))
    msg = str(info.value)
    assert "\n" not in msg and "pp=2 needs a lit_titan.PretrainModule" in msg, msg


def test_manual_optimisation_of_a_pretrain_module_is_refused_in_one_line():
    """The step runner owns a PretrainModule's optimizer step (under pp2 manual optimisation never trained and never
    ended): refused before any process-group work."""
    from lit_titan import PretrainModule, TitanStrategy

    class ByHand(PretrainModule):
        def __init__(self) -> None:
            super().__init__("llama3_debug")
            self.automatic_optimization = False

    strategy = TitanStrategy(pp=2)
    strategy._lightning_module = ByHand()
    with pytest.raises(TypeError) as info:
        strategy.setup_environment()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("ByHand.automatic_optimization=False"), msg


# ---- Lightning's own ModelParallelStrategy behaviours, held by TitanStrategy with a plain module ----------------
def _plain_strategy(module, **kwargs):
    from unittest.mock import Mock

    from lit_titan import TitanStrategy

    strategy = TitanStrategy(**kwargs)
    strategy.model = module
    strategy._lightning_module = module
    strategy._accelerator = Mock()
    strategy._parallel_devices = [torch.device("cpu")]
    return strategy


def test_lightning_size_names_are_the_degrees():
    from lit_titan import TitanStrategy

    degrees = TitanStrategy(data_parallel_size=2, tensor_parallel_size=4)._degrees
    assert (degrees["dp_shard"], degrees["tp"]) == (2, 4)
    assert TitanStrategy(data_parallel_size="auto")._degrees == TitanStrategy()._degrees


def test_the_device_mesh_before_the_processes_start_is_refused():
    from lit_titan import TitanStrategy

    with pytest.raises(RuntimeError, match="Accessing the device mesh .* not allowed"):
        _ = TitanStrategy().device_mesh


def test_a_plain_module_must_parallelise_itself_in_configure_model():
    from unittest.mock import Mock

    import lightning as L

    with pytest.raises(TypeError, match="required to override the `configure_model"):
        _plain_strategy(L.LightningModule()).setup(Mock())

    class Configured(L.LightningModule):
        def configure_model(self) -> None:
            pass

    _plain_strategy(Configured()).setup(Mock())


def test_a_plain_module_built_on_the_meta_device_is_materialised_in_setup():
    from unittest.mock import Mock

    import lightning as L

    class OnMeta(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(2))

        def reset_parameters(self) -> None:  # the module's own buffers (Linear resets its weights)
            self.scale.fill_(2.0)

        def configure_model(self) -> None:
            pass

    with torch.device("meta"):
        module = OnMeta()
    _plain_strategy(module).setup(Mock())
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    assert torch.equal(module.scale, torch.full((2,), 2.0))


# Where TitanStrategy answers otherwise than Lightning's strategy, on purpose: asserted here, said in the README.
def test_sizes_that_do_not_multiply_to_the_world_are_one_line_naming_the_fix():
    """Lightning: "multiplied should equal the world size"; here the config's words, before any process group."""
    from lit_titan.strategies.parallel_dims import LayoutError, ParallelDims

    with pytest.raises(LayoutError) as info:
        ParallelDims.resolve(8, dp_shard=2, tp=3)
    msg = str(info.value)
    assert "\n" not in msg and "but the world size is 8" in msg and "parallel.dp_shard=-1" in msg, msg


def test_storage_options_and_a_checkpoint_that_is_neither_a_file_nor_a_sharded_directory_are_refused(tmp_path):
    """As Lightning's: no ``storage_options`` (its CheckpointIO is not used); an empty directory is no checkpoint."""
    from unittest.mock import Mock

    import lightning as L

    from lit_titan import TitanStrategy
    from lit_titan.checkpoint.layout import CheckpointError

    with pytest.raises(TypeError, match="storage_options"):
        TitanStrategy().save_checkpoint({}, tmp_path / "x", storage_options=Mock())
    strategy = _plain_strategy(L.LightningModule())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no .metadata|is not a checkpoint"):
        strategy.load_checkpoint(tmp_path / "empty")


def test_a_module_wrapped_by_the_legacy_fsdp_is_refused():
    """FSDP2 only, as Lightning's strategy (the plain path is its setup)."""
    from unittest.mock import Mock

    import lightning as L
    from torch.distributed.fsdp import FullyShardedDataParallel

    class Configured(L.LightningModule):
        def configure_model(self) -> None:
            pass

    module = Configured()
    module.modules = Mock(return_value=[Mock(spec=FullyShardedDataParallel)])
    with pytest.raises(TypeError, match="only supports the new FSDP2 APIs"):
        _plain_strategy(module).setup(Mock())
