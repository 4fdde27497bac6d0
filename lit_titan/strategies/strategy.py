"""TitanStrategy: the one place where parallel execution lives.

Extends Lightning's ``ModelParallelStrategy`` (2-D, user-parallelised) with:
- a 5-D mesh (pp, dp_replicate, dp_shard, cp, tp) validated before any process-group work;
- parallelisation in one fixed order from the model family's ``ParallelPlan``
  (TP/SP -> CP -> EP -> activation checkpointing -> compile -> FSDP/HSDP), then seeded materialisation;
- a plain ``LightningModule`` (not a ``PretrainModule``) trained as Lightning's own strategy trains it: its
  ``configure_model`` parallelises over a mesh with Lightning's dim names, its hooks run as written;
- reductions over the data-parallel group (not the world); under gradient accumulation FSDP
  reduce-scatters every micro-batch (gradients stay sharded) and HSDP defers only its replicate
  all-reduce (``grad_reduce_scatter``); loss-parallel contexts spanning forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from dataclasses import fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_titan.checkpoint import CheckpointWriter, load_sharded
from lit_titan.checkpoint.single_file import load_single_file
from lit_titan.fault_tolerance.settings import FaultToleranceConfig
from lit_titan.models.registry import spec_of_model
from lit_titan.observe.log_cadence import amortise_sigterm_check
from lit_titan.observe.phases import phase
from lit_titan.strategies.context_parallel import ContextParallel
from lit_titan.strategies.contract import ModuleContract, SequenceData, module_contract
from lit_titan.strategies.elastic import init_process_group as init_elastic_process_group
from lit_titan.strategies.elastic import under_torchelastic
from lit_titan.strategies.expert_parallel import apply_expert_parallel, moe_layers
from lit_titan.strategies.fsdp import (
    PP_LAST_MICROBATCH,
    FSDPConfig,
    apply_expert_fsdp,
    apply_fsdp,
    fsdp_modules,
    mixed_precision_for,
)
from lit_titan.strategies.grad_norm import clip_grad_norm_
from lit_titan.strategies.host_threads import cpu_threads
from lit_titan.strategies.parallel_dims import LayoutError, ParallelDims
from lit_titan.strategies.parallel_plan import ParallelPlan
from lit_titan.strategies.pipeline import (
    PipelineConfig,
    PipelineRunner,
    build_rank_model,
    share_root_buffers,
    split_units,
    stage_ids,
)
from lit_titan.strategies.precision import float32_matmul_precision
from lit_titan.strategies.settings import GRAD_REDUCE_SCATTER, ParallelConfig
from lit_titan.strategies.step import StepRunner
from lit_titan.strategies.tensor_parallel import StyleRewrite, apply_tensor_parallel

# Slots, in application order, where callbacks (Float8, activation checkpointing, compile) plug
# transforms in. Each transform is called as fn(model, plan, strategy).
TRANSFORM_SLOTS = ("convert", "activation_checkpointing", "compile")
Transform = Callable[[nn.Module, ParallelPlan, "TitanStrategy"], None]


class TitanStrategy(ModelParallelStrategy):
    """Implements ``strategies/contract.py``'s ``StrategyContract``, what the module and callbacks may ask."""

    # strategies/contract.py's ``contract`` reads this: the class keeps StrategyContract itself.
    keeps_strategy_contract = True
    # PretrainModule reads this: the strategy, not the module, builds the real weights.
    owns_parallelization = True
    # Callbacks register transforms here (register_transform); the strategy applies them in order.
    runs_transforms = True
    # Each Lightning batch is a rank's whole optimizer step, trained by the step runner (strategies/step.py).
    runs_steps = True
    strategy_name = "titan"

    def __init__(
        self,
        parallel: ParallelConfig | None = None,
        *,
        plan: ParallelPlan | None = None,
        dims: ParallelDims | None = None,
        tf32: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        fault_tolerance: FaultToleranceConfig | None = None,
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
        **settings: Any,
    ) -> None:
        """``parallel``: the degrees and parallel settings (the config's ``parallel`` group); any of its
        fields may also be given by name (``TitanStrategy(tp=2)``), overriding ``parallel``'s.
        ``data_parallel_size``/``tensor_parallel_size``: Lightning's ``ModelParallelStrategy`` names for
        ``dp_shard``/``tp``, so a Lightning script swaps the class and keeps its arguments.
        ``dims``: degrees already resolved and checked (a ``JobSpec``'s), used as they are.
        ``fault_tolerance``: replica-group fault tolerance (``lit_titan/fault_tolerance/lightning_step.py``)."""
        super().__init__(
            data_parallel_size=1,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if not save_distributed_checkpoint:
            raise ValueError(
                "TitanStrategy(save_distributed_checkpoint=False): checkpoints are sharded (DCP, resharded into "
                "any layout on load); for the weights as safetensors run `lit-titan export CHECKPOINT_DIR OUT_DIR`"
            )
        unknown = sorted(set(settings) - {f.name for f in fields(ParallelConfig)})
        if unknown:
            raise TypeError(
                f"TitanStrategy got unknown argument(s) {unknown}; the parallel settings are "
                f"{[f.name for f in fields(ParallelConfig)]}"
            )
        for name, size in (("dp_shard", data_parallel_size), ("tp", tensor_parallel_size)):
            if size is not None and size != "auto":  # "auto": this strategy's default (FSDP over every rank)
                settings.setdefault(name, int(size))
        p = replace(parallel or ParallelConfig(), **settings)
        self.parallel = p
        self._degrees = p.degrees
        self._resolved_dims = dims
        self._plan = plan
        self.fsdp_config = FSDPConfig(reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload)
        if p.grad_reduce_scatter not in GRAD_REDUCE_SCATTER:
            raise ValueError(f"grad_reduce_scatter={p.grad_reduce_scatter!r}: choose one of {GRAD_REDUCE_SCATTER}")
        if p.grad_reduce_scatter == "last_microbatch" and p.pp > 1:
            raise ValueError(PP_LAST_MICROBATCH)
        self.grad_reduce_scatter = p.grad_reduce_scatter
        self.loss_parallel = p.loss_parallel
        self.tf32 = tf32
        self._saved_matmul_precision: str | None = None  # restored at teardown (in-process fits)
        self.pipeline_config = PipelineConfig(
            schedule=p.pp_schedule,
            microbatches=p.pp_microbatches,
            stages_per_rank=p.pp_stages_per_rank,
            stages=tuple(tuple(s) for s in p.pp_stages) if p.pp_stages else None,
        )
        if p.pp > 1:
            self.pipeline_config.validate()
        self.pipeline: PipelineRunner | None = None
        self.context_parallel: ContextParallel | None = None
        self._views: list[nn.Module] = []
        self.parallel_dims: ParallelDims | None = None
        self._transforms: dict[str, list[Transform]] = {slot: [] for slot in TRANSFORM_SLOTS}
        self._tp_style_rewrites: list[StyleRewrite] = []
        # Set by parallelize(): whether FSDP wraps the model, and this rank's pipeline stages.
        self.fsdp_applied = False
        self.stage_ids: list[int] = [0]
        self.num_stages = 1
        self.mesh_views: dict = {}
        # A plain LightningModule's mesh: (data_parallel, tensor_parallel), Lightning's names for its configure_model.
        self._lightning_mesh: Any = None
        # Sharded, async, atomically published checkpoints (lit_titan.checkpoint); the
        # Checkpointing callback decides when to save and configures it.
        self.checkpoint_writer = CheckpointWriter()
        # Under torchrun: which attempt this is, agreed by every node (None: not started by torchrun).
        self.restart_attempt: int | None = None
        # Whether setup_environment started the process group (then release_process_group destroys it).
        self._owns_process_group = False
        # The model this strategy parallelised and filled: a Trainer back for validate/test/predict after fit
        # finds it in the module and keeps it, trained weights, mesh and groups (setup, setup_environment).
        self._made_model: nn.Module | None = None
        # fault_tolerance.enabled: each replica group is its own world; this runs the step across them.
        self.fault_tolerance = fault_tolerance or FaultToleranceConfig()
        self.replica_step: Any = None
        self.job_dims: ParallelDims | None = None  # the whole job's degrees (resolve_dims under fault tolerance)
        # The only owner of an optimizer step; Lightning's accumulate_grad_batches, when a user sets it, becomes
        # its micro-batch count (setup_environment takes it over).
        self.step_runner = StepRunner(self)
        self.absorbed_accumulation = 1

    # ---- layout ---------------------------------------------------------------------------------
    def resolve_dims(self) -> ParallelDims:
        """Resolve and validate the degrees against world size, model and data (no process groups).

        The batch split is checked by the datamodule, which knows its data-parallel coordinates.
        Degrees given resolved (``dims=``, a checked JobSpec's) are only held against the world size.
        Under fault tolerance the job's degrees are checked, those of one replica group returned.
        """
        world = self.num_nodes * self.num_processes if self.fault_tolerance.enabled else self.world_size
        if self._resolved_dims is not None:
            if self._resolved_dims.world_size != world:
                raise LayoutError(
                    f"the resolved degrees {self._resolved_dims.as_dict()} are for "
                    f"{self._resolved_dims.world_size} processes, this job has {world}; "
                    f"check cluster.devices x cluster.num_nodes"
                )
            return self._replica_group_dims(self._resolved_dims)
        dims = ParallelDims.resolve(world, **self._degrees)
        self._check_plain_layout(dims)
        args = module_contract(self.lightning_module).model_args
        data = self.lightning_module.trainer.datamodule if self.lightning_module is not None else None
        dims.validate(
            n_heads=args.n_heads if args is not None else None,
            n_kv_heads=args.kv_heads if args is not None else None,
            seq_len=data.seq_len if isinstance(data, SequenceData) else None,
        )
        if args is not None:
            from lit_titan.models.registry import num_experts

            dims.validate_experts(num_experts(args))
        return self._replica_group_dims(dims)

    def _plain(self) -> bool:
        """The module is a plain LightningModule: it parallelises itself and owns its steps (Lightning's way)."""
        return self.lightning_module is not None and not isinstance(self.lightning_module, ModuleContract)

    def _check_plain_layout(self, dims: ParallelDims) -> None:
        """Pipeline, context and expert parallelism and fault tolerance run the step through a ``PretrainModule``'s
        override points; a plain module gets data and tensor parallelism, refused otherwise before any work."""
        if not self._plain():
            return
        asked = {k: v for k, v in (("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)) if v > 1}
        if self.fault_tolerance.enabled:
            asked["fault_tolerance"] = 1
        if asked:
            what = ", ".join(f"{k}={v}" for k, v in asked.items())
            raise LayoutError(
                f"{type(self.lightning_module).__name__} is a plain LightningModule: TitanStrategy gives it data and "
                f"tensor parallelism (its configure_model applies them); {what} needs a lit_titan.PretrainModule"
            )

    def _replica_group_dims(self, dims: ParallelDims) -> ParallelDims:
        """``dims`` as they are; under fault tolerance those of one replica group (its own world)."""
        if not self.fault_tolerance.enabled:
            return dims
        self.job_dims = dims
        return ParallelDims.resolve(
            dims.world_size // dims.dp_replicate, pp=dims.pp, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp, ep=dims.ep
        )

    @property
    def _job_rank(self) -> int:
        """This process's rank in the whole job (under fault tolerance Lightning's ranks are its group's;
        launched per replica group, ``fault_tolerance.replica_id`` says which: fault_tolerance/launch.py)."""
        from lit_titan.fault_tolerance.launch import job_rank

        launched = self.node_rank * self.num_processes + self.local_rank
        return job_rank(launched, self._ft_group_size(), self.fault_tolerance.replica_id)

    def _ft_group_size(self) -> int:
        replicas = self._resolved_dims.dp_replicate if self._resolved_dims else self._degrees["dp_replicate"]
        return self.num_nodes * self.num_processes // max(replicas, 1)

    @property
    def data_parallel_size(self) -> int:
        # Under fault tolerance every rank loads the whole global batch (ReplicaStep picks its samples).
        return self.parallel_dims.dp if self.parallel_dims and self.replica_step is None else 1

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel_dims.dp_rank(self.global_rank) if self.parallel_dims and self.replica_step is None else 0

    @property
    def training_devices(self) -> int:
        # Under fault tolerance Lightning's world is one replica group, which trains only its share.
        return self.replica_step.live_ranks if self.replica_step is not None else self.world_size

    def set_world_ranks(self) -> None:
        """Under fault tolerance Lightning's ranks are the replica group's (its world); only the job's
        rank 0 writes what rank zero writes (logs, the run directory's files)."""
        if not self.fault_tolerance.enabled or self.cluster_environment is None:
            return super().set_world_ranks()
        from lit_titan.fault_tolerance.lightning_step import set_group_ranks

        set_group_ranks(self.cluster_environment, self._job_rank, self._ft_group_size())

    @property
    def is_global_zero(self) -> bool:
        if self.fault_tolerance.enabled:
            return self._job_rank == 0
        return super().is_global_zero

    @property
    def pp_group(self) -> torch.distributed.ProcessGroup | None:
        if self.parallel_dims is None or self.parallel_dims.pp == 1:
            return None
        return self._pp_group

    @property
    def batch_group(self) -> torch.distributed.ProcessGroup | None:
        dims = self.parallel_dims
        if dims is None or dims.dp_replicate * dims.dp_shard * dims.cp == 1:
            return None
        return self.mesh_views["dp_cp"].get_group()

    @property
    def cp_group(self) -> torch.distributed.ProcessGroup | None:
        if self.parallel_dims is None or self.parallel_dims.cp == 1:
            return None
        return self._device_mesh["cp"].get_group()

    @property
    def device_mesh(self) -> Any:
        """Lightning's: for a plain module the (data_parallel, tensor_parallel) mesh its configure_model uses."""
        return self._lightning_mesh if self._lightning_mesh is not None else super().device_mesh

    @property
    def mesh(self) -> Any:
        """The 5-D DeviceMesh once ``init_layout`` ran, else None (Lightning's ``device_mesh`` asserts)."""
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def plan_for(self, model: nn.Module) -> ParallelPlan:
        """``plan=`` when given (a model of no registered family), else its family's ``ModelSpec.plan``."""
        return self._plan if self._plan is not None else spec_of_model(model).plan

    def register_transform(self, slot: str, fn: Transform) -> None:
        """Callbacks ask for transforms; the strategy decides when they run (TRANSFORM_SLOTS order)."""
        if slot not in self._transforms:
            raise ValueError(f"unknown transform slot {slot!r}; choose one of {TRANSFORM_SLOTS}")
        self._transforms[slot].append(fn)

    def register_tp_style_rewrite(self, fn: StyleRewrite) -> None:
        """Callbacks rewrite the plan's TP styles per module: ``fn(fqn, module, style) -> style``.

        Applied in registration order to every style of ``plan_for(model)`` just before TP applies it
        (after the ``convert`` transforms, so ``module`` is the converted one); e.g. Float8's float8 styles.
        """
        self._tp_style_rewrites.append(fn)

    # ---- Lightning lifecycle --------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        # One process starts no children, so it needs no launcher; without one Lightning also
        # accepts the strategy in a notebook (it refuses the subprocess launcher there).
        if self.num_processes * self.num_nodes == 1:
            self._launcher = None
            return
        super()._configure_launcher()

    def setup_environment(self) -> None:
        module = self.lightning_module
        if isinstance(module, ModuleContract) and not module.automatic_optimization:
            raise TypeError(
                f"{type(module).__name__}.automatic_optimization=False: TitanStrategy runs each optimizer step of "
                f"a PretrainModule itself; optimise by hand in a plain LightningModule instead"
            )
        if not self._plain():  # a plain module's accumulation stays Lightning's
            self._absorb_accumulation()
        # Validate before the process group and mesh exist: a bad layout fails in seconds.
        self.parallel_dims = self.resolve_dims()
        self._set_matmul_precision()
        # Lightning's Strategy.setup_environment does this (torch.cuda.set_device on GPUs); without it
        # every rank's current CUDA device would be whatever DeviceMesh guesses.
        self.accelerator.setup_device(self.root_device)
        if self.root_device.type == "cpu":
            # N processes on one host share its cores (OMP_NUM_THREADS wins); else each takes them all.
            torch.set_num_threads(cpu_threads(self.num_processes))
        self._owns_process_group = self._owns_process_group or not torch.distributed.is_initialized()
        self._setup_distributed()
        from lit_titan.observe import peer_exit

        peer_exit.remember(self.global_rank, self.world_size, self._launcher)  # for the line if a peer dies
        if not self._reentered():  # the made model's DTensors hold the mesh it was parallelised over
            self.init_layout(self.parallel_dims, self.root_device.type)
        if self._plain() and self._lightning_mesh is None:  # kept on re-entry: its DTensors hold it
            from torch.distributed.device_mesh import init_device_mesh

            dims = self.parallel_dims
            self._lightning_mesh = init_device_mesh(
                self.root_device.type, (dims.dp, dims.tp), mesh_dim_names=("data_parallel", "tensor_parallel")
            )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh

    def _absorb_accumulation(self) -> None:
        """Lightning must hand over whole steps: ``Trainer(accumulate_grad_batches=N)`` becomes the step runner's
        N micro-batches per batch (the same gradient, the rank's batch then holds the whole step)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and int(trainer.accumulate_grad_batches) > 1:
            self.absorbed_accumulation = int(trainer.accumulate_grad_batches)
            trainer.accumulate_grad_batches = 1

    def _set_matmul_precision(self) -> None:
        """TF32 matmuls for 32-true on CUDA (``strategies/precision.py``); undone at teardown."""
        choice = float32_matmul_precision(self.precision_plugin.precision, self.root_device.type, self.tf32)
        if choice is not None and self._saved_matmul_precision is None:
            self._saved_matmul_precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(choice)

    def _restore_matmul_precision(self) -> None:
        if self._saved_matmul_precision is not None:
            torch.set_float32_matmul_precision(self._saved_matmul_precision)
            self._saved_matmul_precision = None

    def _setup_distributed(self) -> None:
        if self.fault_tolerance.enabled:
            from lit_titan.fault_tolerance.lightning_step import ReplicaStep

            if torch.distributed.is_initialized():  # a world spanning the groups: a dead one would hang it
                raise RuntimeError(
                    "fault_tolerance.enabled=true: a process group exists already; each replica group starts "
                    "its own (docs/fault_tolerance.md), start the job in fresh processes"
                )

            from lit_titan.fault_tolerance.launch import check_launch, launch_world

            job_world = self.num_nodes * self.num_processes
            check_launch(self.fault_tolerance.replica_id, launch_world(), job_world, self._ft_group_size())
            self.replica_step = ReplicaStep.start_world(
                self.fault_tolerance,
                self._job_rank,
                self._ft_group_size(),
                self.job_dims.dp_replicate,
                self._get_process_group_backend(),
                self._timeout or default_pg_timeout,
            )
        elif not torch.distributed.is_initialized() and under_torchelastic():
            # torchrun (one node or several): rendezvous in a store namespace that every node agrees
            # is this attempt's (strategies/elastic.py says why torch's env:// is not enough).
            self.restart_attempt = init_elastic_process_group(
                self._get_process_group_backend(),
                self._timeout or default_pg_timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
        super()._setup_distributed()  # Lightning's: ranks, seeds; skips the init when already done

    def init_layout(self, dims: ParallelDims, device_type: str) -> None:
        """Mesh, its flattened views and the CP engine over the live process group.

        Training calls this from ``setup_environment``; the planner calls it over a fake process
        group of the fleet's world size, so both parallelise through the same state.
        """
        self.parallel_dims = dims
        self._device_mesh, self.mesh_views = dims.build_mesh(device_type)
        # Read every step (grad norm): slicing the mesh each time is host work (.tolist() of its ranks).
        self._pp_group = self._device_mesh["pp"].get_group() if dims.pp > 1 else None
        if dims.cp > 1:
            self.context_parallel = ContextParallel(self._device_mesh["cp"].get_group(), self.parallel.cp_mode)

    def _reentered(self) -> bool:
        """The Trainer is back (validate/test/predict or a save after fit) with the model this strategy made."""
        module = self.lightning_module
        return self._made_model is not None and module_contract(module).model is self._made_model

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        if self._plain():
            if self._plan is not None:  # the strategy parallelises the module's `model` with the plan
                self._setup_planned(trainer)
            else:  # Lightning's own: configure_model parallelised it; materialise, optimizers
                super().setup(trainer)
            # Lightning clips with torch's clip_grad_norm_ over every parameter at once, which refuses gradients on
            # several meshes or a mix of DTensors and plain tensors (tensor parallelism of some modules only).
            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
                plugin.main_params(optimizer), clip_val
            )
            return
        self.accelerator.setup(trainer)
        if self._reentered():  # its trained weights, not a second parallelisation and a fresh init
            self._finish_setup(trainer)
            return
        module = module_contract(self.lightning_module)
        model = module.model
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(self).__name__} parallelises the `model` of a lit_titan.PretrainModule, built in "
                f"configure_model(); {type(self.lightning_module).__name__}.model is {type(model).__name__}"
            )
        precision = self.precision_plugin.precision
        mixed_precision_for(precision)  # refuse unsupported flags before any work
        # A compute_loss of the user's own sees whole logits: torch's loss parallel covers plain cross-entropy
        # only (label smoothing, z-loss or a mask would meet vocabulary-sharded DTensors and fail or be wrong).
        self.loss_parallel = self.parallel.loss_parallel and not _own_loss(self.lightning_module)
        model, self._views = self.parallelize(model, precision)
        module.model = model  # under PP: this rank's stages only, original parameter names
        self.materialize(model, seed=module.seed)
        module.load_initial_weights()  # e.g. model.init_from_hf, into the sharded parameters
        if self.parallel_dims.pp > 1:
            share_root_buffers(model, self._views)
            self.pipeline = PipelineRunner(
                self._views,
                self.stage_ids,
                self.num_stages,
                self.pipeline_config,
                self._device_mesh["pp"].get_group(),
                self.root_device,
            )
        if self.fsdp_applied and precision == "bf16-mixed":
            # FSDP's MixedPrecisionPolicy already computes in bf16 with fp32 master weights and
            # reductions; Lightning's autocast on top would only add casts.
            self.precision_plugin = Precision()
        self._made_model = model
        self._finish_setup(trainer)

    def _setup_planned(self, trainer: pl.Trainer) -> None:
        """A plain module under ``TitanStrategy(plan=...)``: its ``model`` is parallelised by the plan in the same
        order as a family's (TP, activation checkpointing, compile, FSDP); its steps stay its own."""
        from lightning.fabric.utilities.init import _materialize_distributed_module

        module = self.lightning_module
        self.accelerator.setup(trainer)
        if not self._reentered():
            model = module_contract(module).model
            if model is None:
                raise TypeError(
                    f"TitanStrategy(plan=...) parallelises the `model` submodule of {type(module).__name__}, which "
                    f"has none; set self.model to the network (or parallelise it in configure_model, without plan=)"
                )
            self.loss_parallel = False  # the module's own loss sees whole logits
            model, self._views = self.parallelize(model, self.precision_plugin.precision)
            module.model = self._made_model = model
            _materialize_distributed_module(self.model, self.root_device)  # meta weights: reset_parameters
            self.model = self.precision_plugin.convert_module(self.model)
        self._finish_setup(trainer)

    def _finish_setup(self, trainer: pl.Trainer) -> None:
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.replica_step is not None and self.replica_step.rejoining:
                self.replica_step.rejoin(trainer, list(self.model.parameters()), self.optimizers[0])

    def parallelize(self, model: nn.Module, precision: str) -> tuple[nn.Module, list[nn.Module]]:
        """Apply every parallelism in the documented order (docs/architecture.md).

        Returns the model this rank trains (under PP: the union of its stages) and the modules the
        rest of the plan was applied to (one per pipeline stage; else the model itself).
        """
        dims, mesh, plan = self.parallel_dims, self._device_mesh, self.plan_for(model)
        self._run_transforms("convert", model, plan)
        views = [model]
        fsdp_config = self.fsdp_config
        if dims.pp > 1:
            model, views = self._split_pipeline(model, plan)
            # Pipeline stages run several micro-batches between forward and backward; resharding
            # after forward gave wrong gradients with zero-bubble schedules, silently
            # (tests/parity/test_pipeline.py::test_zero_bubble_schedules_match_single_process).
            fsdp_config = replace(fsdp_config, reshard_after_forward=False)
        param_dtype, _ = mixed_precision_for(precision)
        for view in views:
            if dims.tp > 1:
                apply_tensor_parallel(view, mesh["tp"], plan, self.loss_parallel, self._tp_style_rewrites)
            if self.context_parallel is not None:
                if plan.attention_cores is None:
                    raise TypeError(
                        f"the ParallelPlan of {type(view).__name__} defines no attention_cores; "
                        f"context parallelism (parallel.cp > 1) needs them"
                    )
                self.context_parallel.apply(view, plan.attention_cores(view))
            if dims.ep > 1:
                # with tp the experts are split over ep x tp, each tp rank computing its share of the tokens
                tp_mesh = mesh["tp"] if dims.tp > 1 else None
                apply_expert_parallel(view, self.mesh_views["ep_tp" if tp_mesh else "ep"], tp_mesh)
            self._run_transforms("activation_checkpointing", view, plan)
            self._run_transforms("compile", view, plan)
            if dims.dp_replicate * dims.fsdp_size > 1 or param_dtype is not None:
                # HSDP needs the 2-D (replicate, shard) mesh, only reachable by slicing the root mesh.
                fsdp_mesh = (
                    mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else self.mesh_views["dp_shard_cp"]
                )
                if dims.ep > 1:
                    apply_expert_fsdp(
                        [m.experts for m in moe_layers(view)],
                        self.mesh_views["dp_replicate_efsdp" if dims.dp_replicate > 1 else "efsdp"],
                        precision,
                        fsdp_config,
                        divide_factor=dims.dp * dims.cp,
                    )
                apply_fsdp(plan.fsdp_units(view), view, fsdp_mesh, precision, fsdp_config)
                self.fsdp_applied = True
        return model, views

    def _split_pipeline(self, model: nn.Module, plan: ParallelPlan) -> tuple[nn.Module, list[nn.Module]]:
        if plan.pipeline_units is None:
            raise TypeError(
                f"the ParallelPlan of {type(model).__name__} defines no pipeline_units; "
                f"pipeline parallelism (parallel.pp > 1) needs them"
            )
        cfg, dims = self.pipeline_config, self.parallel_dims
        self.num_stages = dims.pp * cfg.per_rank
        units = plan.pipeline_units(model)
        names = split_units(units, self.num_stages, cfg.stages)
        self.stage_ids = stage_ids(self._device_mesh["pp"].get_local_rank(), dims.pp, cfg)
        return build_rank_model(model, units, [names[i] for i in self.stage_ids])

    def materialize(self, model: nn.Module, seed: int) -> None:
        """meta -> real storage, then the model's seeded, layout-independent init."""
        init_device = torch.device("cpu") if self.fsdp_config.cpu_offload else self.root_device
        model.to_empty(device=init_device)
        model.init_weights(seed=seed, buffer_device=self.root_device)

    def _run_transforms(self, slot: str, model: nn.Module, plan: ParallelPlan) -> None:
        for fn in self._transforms[slot]:
            fn(model, plan, self)

    def teardown(self) -> None:
        self.checkpoint_writer.wait(agree=False)  # a save in flight needs the process group
        if self.replica_step is not None:
            self.replica_step.close()
        super().teardown()
        self._restore_matmul_precision()  # an in-process fit leaves torch as it found it
        if self.replica_step is not None:  # each replica group's world is its own: no re-entry (fault_tolerance/)
            self.release_process_group()
        # Otherwise the process group lives on, as under Lightning's strategies: the made model's groups serve
        # validate/test/predict and save_checkpoint after fit. Whoever is done with the Trainer releases it.

    def release_process_group(self) -> None:
        """Destroy the process group this strategy started, once its Trainer is done (``lit_titan.train`` calls
        it after fit): an in-process run (notebook, Python API) must not leave it behind, or the next fit, the
        planner's fake group or a data pipeline would take it for a live job. No-op for a group it found."""
        self._made_model = None
        if self._owns_process_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._owns_process_group = False

    def on_train_start(self) -> None:
        super().on_train_start()
        # Lightning broadcasts a SIGTERM flag and reads it back before every batch of a
        # multi-process run: a collective and a host sync per micro-batch. Check on logging steps.
        amortise_sigterm_check(self.lightning_module.trainer)
        if self.replica_step is not None:
            self.replica_step.on_train_start(
                self.lightning_module.trainer, list(self.model.parameters()), self.optimizers[0]
            )

    # ---- collectives and contexts ---------------------------------------------------------------
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        """Reduce over the data(+context)-parallel group by default: TP/PP peers hold copies, not samples."""
        if group is None and self._device_mesh is not None:
            group = self.mesh_views["dp_cp"].get_group()
        if isinstance(tensor, DTensor):  # a loss under loss parallel (Replicate): logged as the plain tensor
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = super().reduce(flag, group=torch.distributed.group.WORLD if self._device_mesh else None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this around every non-final micro-batch of gradient accumulation.

        ``every_microbatch`` (default): FSDP still reduce-scatters, so between micro-batches each
        rank holds only its gradient shard; turning the sync off would keep the *unsharded* fp32
        gradients of the whole model on every rank (8B: 29.9 GiB instead of 3.7). Under HSDP
        only the all-reduce over ``dp_replicate`` waits for the last micro-batch (FSDP adds the
        reduce-scattered pieces meanwhile, still sharded). ``last_microbatch``: no reduction until
        the last micro-batch (one reduce-scatter per step, unsharded gradients in between).
        """
        roots = [self.model, *self._views] if self.model is not None else []
        modules = fsdp_modules(roots)
        if self.grad_reduce_scatter == "last_microbatch":
            for m in modules:
                m.set_requires_gradient_sync(False, recurse=False)
        elif self.parallel_dims is not None and self.parallel_dims.dp_replicate > 1:
            for m in modules:
                m.set_requires_all_reduce(False, recurse=False)
        else:
            modules = []
        try:
            yield
        finally:
            for m in modules:  # both the reduce-scatter and the all-reduce back on
                m.set_requires_gradient_sync(True, recurse=False)

    @property
    def backward_in_training_step(self) -> bool:
        """True under PP and fault tolerance, whose step has no forward of its own to time apart from its
        backward (the Timeline times them as one phase). Every step runs its backward in training_step."""
        return self.pipeline is not None or self.replica_step is not None

    def _loss_context(self):
        if self.parallel_dims is not None and self.parallel_dims.tp > 1 and self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The rank's whole optimizer step, by the step runner: the module's ``split_batch``, ``compute_loss``
        and ``record_train_loss`` under every layout (subclasses customise those, not ``training_step``)."""
        module = self.lightning_module
        if self._plain():
            return super().training_step(*args, **kwargs)
        _refuse_own_step(module, "training_step")
        with self.precision_plugin.train_step_context(), self._loss_context():
            return self.step_runner.train(module, args[0])

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if self._plain():
            return super().validation_step(*args, **kwargs)
        _refuse_own_step(module, "validation_step")
        with self.precision_plugin.val_step_context(), self._loss_context():
            loss = self.step_runner.evaluate(module, args[0])
            module.record_val_loss(loss)
            return loss

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """``trainer.test``: the held-out loss through the step runner (pipeline schedules included), as validation."""
        module = self.lightning_module
        if self._plain():
            return super().test_step(*args, **kwargs)
        _refuse_own_step(module, "test_step")
        with self.precision_plugin.test_step_context(), self._loss_context():
            loss = self.step_runner.evaluate(module, args[0])
            module.record_test_loss(loss)
            return loss

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """``trainer.predict``: the module's ``predict_step`` where a rank holds whole sequences and the whole model;
        refused in one line under pipeline parallelism (the logits live on the last stage) and context parallelism
        (each rank holds a slice of every sequence)."""
        dims = self.parallel_dims
        if not self._plain() and dims is not None and (dims.pp > 1 or dims.cp > 1):
            raise RuntimeError(
                f"trainer.predict under pp={dims.pp} cp={dims.cp}: a rank holds part of the model or of each sequence; "
                f"predict under data and tensor parallelism (a checkpoint of this run loads into any layout)"
            )
        return super().predict_step(*args, **kwargs)

    def _shard_sequence(self, inputs: Tensor, labels: Tensor, extra: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """This rank's slice of the sequence; per-token ``extra`` (document positions and ids) is
        sliced in place the same way (the model and every pipeline stage receive it)."""
        if self.context_parallel is None:
            return inputs, labels
        names = sorted(extra)
        *sliced, local_inputs, local_labels = self.context_parallel.shard(*(extra[n] for n in names), inputs, labels)
        extra.update(zip(names, sliced))
        return local_inputs, local_labels

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The step runner ran every micro-batch's backward in training_step: only the hooks after it run
        (``on_after_backward``; ``on_before_backward`` has no single moment to run at and does not)."""
        if self._plain():  # a plain module's step is Lightning's: its backward too
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Sharded DCP save through :class:`~lit_titan.checkpoint.CheckpointWriter` (async, atomic publish).

        Lightning's own version saves synchronously into the final directory, so a crash mid-save
        leaves a directory that looks like a checkpoint.
        """
        if storage_options is not None:
            raise TypeError("TitanStrategy.save_checkpoint does not take storage_options")
        if self.replica_step is not None and self.replica_step.replica != 0:
            return  # replica groups hold equal copies: group 0 writes (docs/fault_tolerance.md, limits)
        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        clock = module_contract(self.lightning_module).phase_clock
        with phase(clock, "checkpoint"):  # the part that blocks training (staging)
            self.checkpoint_writer.save(
                state, checkpoint, path, rank=self.global_rank, world_size=self.world_size, barrier=self.barrier
            )
        if not self.lightning_module.trainer.training:  # trainer.save_checkpoint outside fit: written on return
            self.checkpoint_writer.wait()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The live sharded model state, not Lightning's CPU copy (``cpu_offload=True``).

        The checkpoint writer copies it once, into reused pinned buffers; a CPU copy here would be
        a second, unpinned and synchronous one (seconds per save at 8B scale: docs/benchmarks.md, "Checkpoint stalls").
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False, cpu_offload=False))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The live sharded optimizer state (see :meth:`lightning_module_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return get_optimizer_state_dict(
            self.model, optimizer, options=StateDictOptions(full_state_dict=False, cpu_offload=False)
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Validate, then load shards into the parallelised model under any layout (DCP reshards); a single file
        (Lightning's ``save_checkpoint`` under another strategy) loads too, each rank taking its parameters."""
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None
        if path.is_file():
            return load_single_file(self.model, list(self.optimizers), path)
        return load_sharded(self.model, list(self.optimizers), path, rank=self.global_rank, world_size=self.world_size)


_RECORDS = {"training_step": "record_train_loss", "validation_step": "record_val_loss", "test_step": "record_test_loss"}


def _refuse_own_step(module: Any, hook: str) -> None:
    """A ``PretrainModule`` subclass's own ``training_step``/``validation_step``/``test_step`` would bypass the step runner
    (and its normaliser): refused in one line naming what to override instead."""
    own = getattr(type(module), hook, None)
    if isinstance(module, ModuleContract) and getattr(own, "__qualname__", "") != f"PretrainModule.{hook}":
        raise TypeError(
            f"{type(module).__name__}.{hook}: TitanStrategy runs each optimizer step itself (one normaliser over "
            f"every layout); override compute_loss, split_batch, count_targets or {_RECORDS[hook]} instead"
        )


def _own_loss(module: Any) -> bool:
    """Whether a ``PretrainModule`` subclass computes its loss itself (``compute_loss`` overridden)."""
    own = getattr(type(module), "compute_loss", None)
    return isinstance(module, ModuleContract) and getattr(own, "__qualname__", "") != "PretrainModule.compute_loss"
