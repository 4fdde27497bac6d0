"""What the module, the strategy and the callbacks may ask of each other, written down.

``StrategyContract``: what ``PretrainModule`` and the callbacks may ask of the training strategy.
``TitanStrategy`` implements it; any other Lightning strategy (single device, DDP, Lightning's own
ModelParallel) is answered by ``PlainStrategy`` with what is true there: the module materialises its
own weights, every rank is a data-parallel rank, no pipeline, no mesh. Callers use
``contract(trainer.strategy)``.

``ModuleContract``: what ``TitanStrategy`` and the callbacks may ask of the LightningModule.
``PretrainModule`` inherits it; any other LightningModule is answered by ``PlainModule`` (no model
arguments, no step statistics). Callers use ``module_contract(pl_module)``. ``SequenceData``: a data
module that states its sequence length, which the layout is checked against.

Typed attributes instead of probes with ``getattr(..., default)``: a renamed attribute fails loudly
and a reader finds each interface in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    import torch.distributed
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import Strategy
    from torch import Tensor, nn
    from torch.distributed.device_mesh import DeviceMesh

    from lit_titan.checkpoint import CheckpointWriter
    from lit_titan.models.registry import ModelArgsLike
    from lit_titan.observe.phases import PhaseClock
    from lit_titan.strategies.parallel_dims import ParallelDims


class StrategyContract(Protocol):
    # True: the strategy builds, parallelises and materialises the weights (the module must not).
    owns_parallelization: bool
    # The degrees of the 5-D layout once the processes exist (None before setup, or without one).
    parallel_dims: ParallelDims | None
    # The torchrun attempt every node agrees on (None when not under torchrun).
    restart_attempt: int | None
    # Writes and prunes the sharded checkpoints (None: the strategy cannot write lit-titan's).
    checkpoint_writer: CheckpointWriter | None

    @property
    def data_parallel_rank(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def training_devices(self) -> int:
        """The processes training the global batch now (per-device figures divide by it): the world size,
        except under replica-group fault tolerance (the job's ranks in live replica groups)."""
        ...

    @property
    def pp_group(self) -> torch.distributed.ProcessGroup | None: ...

    @property
    def batch_group(self) -> torch.distributed.ProcessGroup | None:
        """The ranks that see other parts of one global batch (data x context); None: only this one."""
        ...

    @property
    def cp_group(self) -> torch.distributed.ProcessGroup | None:
        """The context-parallel ranks holding the other parts of this rank's sequences; None without cp."""
        ...

    @property
    def backward_in_training_step(self) -> bool:
        """True under pipeline parallelism and fault tolerance: forward and backward are one phase to time."""
        ...

    @property
    def runs_steps(self) -> bool:
        """True when each Lightning batch is a rank's whole step, trained (backward included) by the strategy's
        step runner in training_step: nothing else zeroes gradients or runs backward."""
        ...

    @property
    def mesh(self) -> DeviceMesh | None: ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...

    @property
    def runs_transforms(self) -> bool:
        """True when ``register_transform`` applies transforms in the strategy's fixed order."""
        ...

    @property
    def root_device(self) -> torch.device: ...

    def register_transform(self, slot: str, fn: Callable[..., None]) -> None: ...

    def register_tp_style_rewrite(self, fn: Callable[..., Any]) -> None:
        """Rewrite the plan's TP styles (Float8's float8 TP) before tensor parallel is applied."""
        ...


class PlainStrategy:
    """The contract's answers for a Lightning strategy that is not lit-titan's."""

    owns_parallelization = False
    parallel_dims = None
    restart_attempt = None
    checkpoint_writer = None
    pp_group = None
    cp_group = None
    backward_in_training_step = False
    runs_steps = False
    mesh = None
    runs_transforms = False

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    @property
    def data_parallel_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def data_parallel_size(self) -> int:
        return self._strategy.world_size

    @property
    def training_devices(self) -> int:
        return self._strategy.world_size

    @property
    def batch_group(self) -> torch.distributed.ProcessGroup | None:
        import torch.distributed as dist

        return dist.group.WORLD if self._strategy.world_size > 1 and dist.is_initialized() else None

    @property
    def cluster_environment(self) -> ClusterEnvironment | None:
        # Lightning's parallel strategies hold one; single-device strategies have none.
        from lightning.pytorch.strategies import ParallelStrategy

        return self._strategy.cluster_environment if isinstance(self._strategy, ParallelStrategy) else None

    @property
    def root_device(self) -> torch.device:
        return self._strategy.root_device

    def register_transform(self, slot: str, fn: Callable[..., None]) -> None:
        raise TypeError(f"{type(self._strategy).__name__} cannot apply lit-titan transforms; use TitanStrategy")

    def register_tp_style_rewrite(self, fn: Callable[..., Any]) -> None:
        self.register_transform("tp_style_rewrite", fn)


def contract(strategy: Any) -> StrategyContract:
    """``strategy`` itself when it implements the contract (TitanStrategy), else its plain answers.

    By the class's own word (``keeps_strategy_contract``), as ``ModuleContract`` is kept by class: this file
    imports nothing above it."""
    return strategy if getattr(type(strategy), "keeps_strategy_contract", False) else PlainStrategy(strategy)


class ModuleContract:
    """What ``TitanStrategy`` and the callbacks may ask of the LightningModule.

    ``PretrainModule`` inherits this and implements every member: the check is by class (a module
    says it keeps the contract), so neither this file nor its callers import the module above them.
    Under pipeline and context parallelism the strategy also runs the step through the module's
    ``unpack_batch``, ``split_batch``, ``model_loss``, ``compute_loss`` and ``record_*_loss``
    (``PretrainModule``'s override points), so those layouts need a ``PretrainModule``.
    """

    # The network to parallelise, built on the meta device in configure_model (None before).
    model: nn.Module | None
    # The model family's arguments (heads, layers, vocabulary): the layout is checked against them and
    # FLOPs are counted from them (None: not a registered family's model).
    model_args: ModelArgsLike | None
    # Seed of the layout-independent init the strategy materialises the weights with.
    seed: int
    # The step-phase clock the Timeline callback attaches while training (None: no timeline runs).
    phase_clock: PhaseClock | None
    # Sequences per micro-batch of the step runner (``strategies/step.py``), which trains each rank's whole step
    # per training batch; None: the data module's micro-batch, else the whole batch.
    step_micro_batch: int | None

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all data-parallel ranks (0 until the first step)."""
        raise NotImplementedError

    @property
    def step_mean_loss(self) -> Tensor | None:
        """This step's mean loss over the micro-batches seen so far, on device (None: none yet)."""
        raise NotImplementedError

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The global gradient norm of the last optimizer step, identical on every rank."""
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        """A fresh, unparallelised model (called under the meta device)."""
        raise NotImplementedError

    def load_initial_weights(self) -> None:
        """Start from given weights once the (sharded) model holds its seeded init."""
        raise NotImplementedError


class PlainModule:
    """The contract's answers for a LightningModule that is not a ``PretrainModule``."""

    model_args = None
    seed = 0
    phase_clock = None  # a Timeline's clock set here is read by nothing: only PretrainModule times phases
    step_micro_batch = None
    tokens_per_step = 0
    step_mean_loss = None
    last_grad_norm = None

    def __init__(self, module: pl.LightningModule | None) -> None:
        self._module = module
        # The module's `model` submodule, if it has one: the network ``TitanStrategy(plan=...)`` parallelises.
        try:
            self.model: nn.Module | None = module.get_submodule("model") if module is not None else None
        except AttributeError:
            self.model = None

    def build_model(self) -> nn.Module:
        raise TypeError(f"{type(self._module).__name__} is not a lit_titan.PretrainModule: it has no build_model()")

    def load_initial_weights(self) -> None:
        return None


def module_contract(module: Any) -> ModuleContract | PlainModule:
    """``module`` itself when it keeps the contract (a ``PretrainModule``), else its plain answers."""
    return module if isinstance(module, ModuleContract) else PlainModule(module)


@runtime_checkable
class SequenceData(Protocol):
    """A data module that states the sequence length of its samples (``PretrainDataModule`` does)."""

    seq_len: int
