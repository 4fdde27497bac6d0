"""What ``PretrainModule`` and the callbacks may ask of the training strategy, written down.

``StrategyContract`` is the whole interface. ``TitanStrategy`` implements it; any other Lightning
strategy (single device, DDP, Lightning's own ModelParallel) is answered by ``PlainStrategy`` with
what is true there: the module materialises its own weights, every rank is a data-parallel rank, no
pipeline, no mesh. Code outside ``strategies/`` calls ``contract(trainer.strategy)`` and reads typed
attributes, instead of probing the strategy with ``getattr(..., default)``, so a renamed attribute
fails loudly and a reader finds the interface in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import Strategy
    from torch.distributed.device_mesh import DeviceMesh

    from lit_titan.checkpoint import CheckpointWriter
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
    def pp_group(self) -> torch.distributed.ProcessGroup | None: ...

    @property
    def batch_group(self) -> torch.distributed.ProcessGroup | None:
        """The ranks that see other parts of one global batch (data x context); None: only this one."""
        ...

    @property
    def backward_in_training_step(self) -> bool:
        """True under pipeline parallelism: the schedule runs backward inside training_step."""
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
    backward_in_training_step = False
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
    """``strategy`` itself when it implements the contract (TitanStrategy), else its plain answers."""
    from lit_titan.strategies.strategy import TitanStrategy

    return strategy if isinstance(strategy, TitanStrategy) else PlainStrategy(strategy)
