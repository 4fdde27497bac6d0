"""The rules that tie config keys together, one small function each.

Single keys (types, ranges, choices) are the schema's (``schema.py``); these run after it, on a config
whose every key is known to be well-typed, with the model's arguments and the resolved degrees at
hand (``spec.validate`` computes them once and passes them in). Each raises ``ConfigError`` (or the
owner's ``LayoutError``) with one ``key=value: what is wrong; what to do`` line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from lit_titan.errors import ConfigError

if TYPE_CHECKING:
    from lit_titan.models.registry import ModelArgsLike as ModelArgs
    from lit_titan.strategies.parallel_dims import ParallelDims


def world_size(cfg: DictConfig) -> int:
    return int(cfg.cluster.devices) * int(cfg.cluster.num_nodes)


def targets(cfg: DictConfig) -> None:
    """Every logger/callback/profiler node is a ``_target_`` node, so instantiate() cannot fail late on its shape."""
    for group in ("logger", "callbacks"):
        for name, node in (cfg.get(group) or {}).items():
            if not isinstance(node, DictConfig) or "_target_" not in node:
                raise ConfigError(
                    f"{group}.{name}={node}: has no _target_; a {group} entry is a node like "
                    f"{{_target_: package.Class, ...}} (see conf/{group}/)"
                )
    profiler = cfg.get("profiler")
    if profiler is not None and (not isinstance(profiler, DictConfig) or "_target_" not in profiler):
        raise ConfigError(
            f"profiler={profiler}: has no _target_; use profiler=simple|advanced|pytorch or a node with _target_"
        )


def loss_chunks(cfg: DictConfig, args: ModelArgs) -> None:
    from lit_titan.job.settings import LossConfig
    from lit_titan.models.loss import resolve_chunk_tokens

    try:
        resolve_chunk_tokens((cfg.get("loss") or {}).get("chunk_tokens", LossConfig().chunk_tokens), args.vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def seq_len_fits_model(cfg: DictConfig, args: ModelArgs) -> None:
    seq_len = int(cfg.data.seq_len)
    if seq_len > args.max_seq_len:
        raise ConfigError(
            f"data.seq_len={seq_len}: exceeds the maximum sequence length {args.max_seq_len} of "
            f"{cfg.model.name}; use data.seq_len<={args.max_seq_len} or raise model.max_seq_len"
        )


def tokenizer_fits_model(cfg: DictConfig, args: ModelArgs) -> None:
    tok = cfg.data.get("tokenizer") or {}
    if tok.get("kind") == "bpe" and tok.get("vocab_size") is not None and int(tok.vocab_size) > args.vocab_size:
        raise ConfigError(
            f"data.tokenizer.vocab_size={tok.vocab_size}: larger than model.vocab_size="
            f"{args.vocab_size}, token ids would index past the embedding; use "
            f"data.tokenizer.vocab_size<={args.vocab_size} or raise model.vocab_size"
        )


def sliding_window_fits_sequence(cfg: DictConfig, args: ModelArgs) -> None:
    seq_len = int(cfg.data.seq_len)
    window = getattr(args, "sliding_window", None)  # families without windowed attention lack the key
    if window is not None and window > seq_len:
        raise ConfigError(
            f"model.sliding_window={window}: exceeds data.seq_len={seq_len} (the window "
            f"would be the whole sequence); lower model.sliding_window or set it to null for full attention"
        )


def hf_weights_match(cfg: DictConfig, args: ModelArgs) -> None:
    if cfg.model.get("init_from_hf"):
        from lit_titan.models.registry import hf_adapter  # lazy: only runs that start from HF weights

        where = f"model.init_from_hf={cfg.model.init_from_hf}"
        try:
            adapter = hf_adapter(args, where)
        except ValueError as err:
            raise ConfigError(f"{err}; set model.init_from_hf=null") from err
        adapter.check_hf_dir(str(cfg.model.init_from_hf), args)  # FileNotFoundError / ConfigError naming the fix


def optimizer(cfg: DictConfig) -> None:
    from lit_titan.optim.build import check_optim

    try:
        check_optim(str(cfg.optim.get("name", "adamw")), cfg.optim.betas, mup=bool(cfg.model.get("mup")))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def fault_drill(cfg: DictConfig) -> None:
    world = world_size(cfg)
    fault = cfg.get("fault") or {}
    if fault.get("kill_rank") is None:
        return
    if fault.get("at_step") is None:
        raise ConfigError(
            f"fault.at_step=null: fault.kill_rank={fault.kill_rank} needs the step to fail at; set "
            f"fault.at_step=N (1..{cfg.trainer.max_steps})"
        )
    if not 0 <= int(fault.kill_rank) < world:
        raise ConfigError(
            f"fault.kill_rank={fault.kill_rank}: not a rank of this {world}-process job; use 0..{world - 1}"
        )
    if int(fault.at_step) > int(cfg.trainer.max_steps):
        raise ConfigError(
            f"fault.at_step={fault.at_step}: after the run's last step (trainer.max_steps="
            f"{cfg.trainer.max_steps}), so the drill never fires; use 1..{cfg.trainer.max_steps}"
        )
    if fault.get("during_save") and not cfg.checkpoint.enabled:
        raise ConfigError("fault.during_save=true: there is no save to fail during; set checkpoint.enabled=true")
    if fault.get("stage_error") and not (cfg.checkpoint.enabled and cfg.checkpoint.get("async_save", True)):
        raise ConfigError(
            f"fault.stage_error={fault.stage_error}: only asynchronous saves stage a copy; set "
            "checkpoint.enabled=true checkpoint.async_save=true"
        )


def preflight(cfg: DictConfig) -> None:
    from lit_titan.observe.diagnostics import check_config

    check_config(cfg.get("preflight"), cfg.get("fault"), world_size(cfg))


def profiler_windows(cfg: DictConfig) -> None:
    """A profiler window outside the run's steps is refused before anything is built."""
    from lit_titan.callbacks.profiler import profile_windows

    for node in (cfg.get("callbacks") or {}).values():
        if str(node.get("_target_", "")).endswith(".Profiler"):
            steps = node.get("steps")
            try:
                profile_windows(
                    int(cfg.trainer.max_steps),
                    list(steps) if steps is not None else None,
                    node.get("every_n_steps"),
                    int(node.get("active", 2)),
                )
            except ValueError as err:
                raise ConfigError(str(err)) from None


def tied_embeddings_without_pipeline(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    if args.tie_embeddings and dims.pp > 1:
        raise ConfigError(
            f"model.tie_embeddings=true: ({cfg.model.name}) not supported with parallel.pp={dims.pp}: "
            f"the embedding (first stage) and the output head (last stage) sit on different ranks, "
            f"and torch's pipeline schedules do not sum a shared weight's gradients across stages; "
            f"use parallel.pp=1 (FSDP/TP keep it tied) or model.tie_embeddings=false"
        )


def layout_fits_family(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """A degree the model family's parallel plan does not cover is refused here, not after the ranks start."""
    from lit_titan.models.registry import spec_of

    spec = spec_of(args)
    for key, degree, covered, what in (
        ("pp", dims.pp, spec.plan.pipeline_units, "pipeline units"),
        ("cp", dims.cp, spec.plan.attention_cores, "context-parallel attention"),
    ):
        if degree > 1 and covered is None:
            raise ConfigError(
                f"parallel.{key}={degree}: the {spec.name} model family's parallel plan has no {what} "
                f"({cfg.model.name}); use parallel.{key}=1 and the ranks for parallel.dp_shard or parallel.tp"
            )


def moe_aux_loss_fits_pp(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Under pp each MoE layer back-propagates its own share of the auxiliary loss; the pooled loss has none."""
    moe = getattr(args, "moe", None)
    if dims.pp > 1 and moe is not None and moe.aux_loss == "pooled" and moe.aux_loss_coef > 0:
        raise ConfigError(
            f"model.moe.aux_loss=pooled: not supported with parallel.pp={dims.pp} (it multiplies counts and "
            f"scores summed over every layer, and the layers sit on different stages); use "
            f"model.moe.aux_loss=global or sequence, or parallel.pp=1"
        )


def moe_step_counts_fit_layout(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """``model.moe.aux_loss_counts=step`` counts with a forward-only pass (under pp torch's schedule ``eval``, which
    fails for the V-shaped schedules) in the module's micro-batch loop, which fault tolerance's step does not run."""
    moe = getattr(args, "moe", None)
    if moe is None or not moe.counts_whole_step:
        return
    ft = bool((cfg.get("fault_tolerance") or {}).get("enabled"))
    from lit_titan.strategies.settings import V_SHAPED

    schedule = cfg.parallel.get("pp_schedule")
    for key, value, on in (
        ("parallel.pp_schedule", schedule, dims.pp > 1 and schedule in V_SHAPED),  # torch's eval fails for them
        ("fault_tolerance.enabled", "true", ft),
    ):
        if on:
            raise ConfigError(
                f"model.moe.aux_loss_counts=step: not supported with {key}={value} yet (the step's counting "
                f"forward runs in the module's own micro-batch loop); set model.moe.aux_loss_counts=micro_batch"
            )


def grad_reduce_scatter(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    from lit_titan.strategies.fsdp import PP_LAST_MICROBATCH

    if cfg.parallel.get("grad_reduce_scatter") == "last_microbatch" and dims.pp > 1:
        raise ConfigError(PP_LAST_MICROBATCH)


def degrees_fit_model(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    dims.validate(n_heads=args.n_heads, n_kv_heads=args.kv_heads, seq_len=int(cfg.data.seq_len))


def experts_fit_ep(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    from lit_titan.models.registry import num_experts

    dims.validate_experts(num_experts(args))  # with tp > 1 the experts are split over ep x tp


def expert_parallel_with_selective_op_checkpointing(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Per-op checkpointing replays a block's ops against a cache indexed by how often each op ran; under
    expert parallel the experts are an FSDP unit inside the block, whose gathers open other profiler ranges
    when the block is recomputed in backward than in its forward, and torch raises on the first miss."""
    ac = (cfg.get("callbacks") or {}).get("activation_checkpointing")
    mode = ac.get("mode", "none") if ac is not None else "none"
    if dims.ep > 1 and mode == "selective_op":
        raise ConfigError(
            f"callbacks.activation_checkpointing.mode={mode}: not supported with parallel.ep={dims.ep} (the "
            f"experts' FSDP unit inside each block runs other profiler ops when the block is recomputed than in "
            f"its forward, which torch's per-op cache refuses); use mode=full or selective_layer"
        )


def expert_parallel_with_fullgraph_compile(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Under expert parallel each block's experts are an FSDP unit of their own; torch.compile skips FSDP's
    hooks (a graph break), which ``fullgraph=true`` turns into an error on the first step."""
    node = (cfg.get("callbacks") or {}).get("compile")
    if dims.ep > 1 and node is not None and node.get("fullgraph", True):
        raise ConfigError(
            f"callbacks.compile.fullgraph=true: not supported with parallel.ep={dims.ep} (the experts' FSDP unit "
            f"inside each block breaks the graph: torch.compile does not trace FSDP's hooks); set "
            f"callbacks.compile.fullgraph=false"
        )


def cp_mode_fits_model(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Ulysses shards the heads over tp x cp: both head counts must divide (every mode takes document masks)."""
    mode = cfg.parallel.get("cp_mode", "allgather")
    unit = dims.tp * dims.cp
    if dims.cp > 1 and mode == "ulysses" and (args.n_heads % unit or args.kv_heads % unit):
        raise ConfigError(
            f"parallel.cp_mode=ulysses: n_heads={args.n_heads} and n_kv_heads={args.kv_heads} must both be "
            f"divisible by parallel.tp x parallel.cp = {unit}; use parallel.cp_mode=ring or allgather, or "
            f"change parallel.cp/parallel.tp"
        )


def attention_backend(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    if getattr(args, "attention", "sdpa") == "flex" and str(cfg.cluster.get("accelerator", "")) == "cpu":
        raise ConfigError(
            "model.attention=flex: cannot train on CPU, torch's flex_attention has no CPU backward "
            "(torch 2.15); use model.attention=sdpa (document masking then uses a dense mask) "
            "or a GPU cluster profile"
        )
    if getattr(args, "attention", "sdpa") == "flex" and dims.cp > 1:
        raise ConfigError(
            "model.attention=flex: not supported with parallel.cp > 1 (CP's attention is SDPA); "
            "set model.attention=sdpa"
        )


def pipeline_validation(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    from lit_titan.strategies.parallel_dims import LayoutError
    from lit_titan.strategies.settings import V_SHAPED

    if dims.pp > 1 and cfg.parallel.pp_schedule in V_SHAPED and cfg.trainer.limit_val_batches:
        raise LayoutError(
            f"trainer.limit_val_batches={cfg.trainer.limit_val_batches}: validation under "
            f"parallel.pp_schedule={cfg.parallel.pp_schedule} fails in torch's schedule eval "
            f"(torch 2.14); set trainer.limit_val_batches=0 or use Interleaved1F1B"
        )


def launcher(cfg: DictConfig, launcher: DictConfig | None) -> None:
    """A submitit job must request exactly the ranks the layout needs: nodes x tasks per node = world size."""
    if launcher is None or "tasks_per_node" not in launcher:
        return
    nodes, tasks = int(launcher.nodes), int(launcher.tasks_per_node)
    world = world_size(cfg)
    if nodes * tasks != world:
        raise ConfigError(
            f"hydra.launcher asks for {nodes} node(s) x {tasks} task(s) = {nodes * tasks} ranks but the "
            f"layout needs cluster.num_nodes x cluster.devices = {world}; drop the hydra.launcher.nodes/"
            f"tasks_per_node overrides (the profile fills them) or change the cluster profile"
        )
    gpus = cfg.cluster.get("gpus_per_node")
    if gpus is not None and cfg.cluster.accelerator in ("gpu", "cuda") and int(cfg.cluster.devices) > int(gpus):
        raise ConfigError(
            f"cluster.devices={cfg.cluster.devices} ranks per node but the profile's nodes have "
            f"cluster.gpus_per_node={gpus}; set cluster.devices<={gpus} and raise cluster.num_nodes"
        )
    if "Local" in str(launcher.get("_target_", "")) and nodes != 1:
        raise ConfigError(
            f"hydra/launcher=submitit_local runs one node, but cluster.num_nodes={nodes}; "
            f"set cluster.num_nodes=1 (or use hydra/launcher=submitit_slurm)"
        )


# In the order ``spec.validate`` runs them (``targets`` first): with the model's arguments, the config
# alone, then with the resolved degrees (the order decides which of two problems a user sees first).
MODEL_RULES = (loss_chunks, seq_len_fits_model, tokenizer_fits_model, sliding_window_fits_sequence, hf_weights_match)


def fault_tolerance_layout(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Replica-group fault tolerance needs replica groups, and its step spans data and pipeline parallelism only (yet)."""
    if not (cfg.get("fault_tolerance") or {}).get("enabled"):
        return
    if dims.dp_replicate < 2:
        raise ConfigError(
            f"fault_tolerance.enabled=true: parallel.dp_replicate={dims.dp_replicate}, there is no other replica "
            "group to go on without one; set parallel.dp_replicate >= 2 (HSDP) or fault_tolerance.enabled=false"
        )
    for name in ("cp", "tp", "ep"):  # lit_titan/fault_tolerance/lightning_step.py: UNSUPPORTED
        if getattr(dims, name) > 1:
            raise ConfigError(
                f"parallel.{name}={getattr(dims, name)}: fault_tolerance.enabled=true trains replica groups of "
                f"FSDP and pipeline ranks only (yet); set parallel.{name}=1 or fault_tolerance.enabled=false "
                "(restart + resume=auto)"
            )
    if cfg.trainer.limit_val_batches:
        raise ConfigError(
            f"trainer.limit_val_batches={cfg.trainer.limit_val_batches}: validation under "
            "fault_tolerance.enabled=true is not supported yet; set trainer.limit_val_batches=0"
        )


def replica_launch(cfg: DictConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """``fault_tolerance.replica_id`` names a group of this layout and comes with the store (one launch per
    replica group: fault_tolerance/launch.py)."""
    ft = cfg.get("fault_tolerance") or {}
    replica = ft.get("replica_id")
    if replica is None:
        return
    if not ft.get("enabled"):
        raise ConfigError(
            f"fault_tolerance.replica_id={replica}: launches one replica group of a fault-tolerant job; "
            "set fault_tolerance.enabled=true, or drop fault_tolerance.replica_id"
        )
    if not 0 <= int(replica) < dims.dp_replicate:
        raise ConfigError(
            f"fault_tolerance.replica_id={replica}: the job has parallel.dp_replicate={dims.dp_replicate} replica "
            f"groups; use 0..{dims.dp_replicate - 1}"
        )
    if not ft.get("store"):
        raise ConfigError(
            f"fault_tolerance.replica_id={replica}: every replica group's launch must meet in one store that "
            "outlives them; start one with `lit-titan store --port PORT` and set fault_tolerance.store=HOST:PORT"
        )


CONFIG_RULES = (optimizer, fault_drill, preflight, profiler_windows)
LAYOUT_RULES = (
    layout_fits_family,
    moe_aux_loss_fits_pp,
    moe_step_counts_fit_layout,
    tied_embeddings_without_pipeline,
    grad_reduce_scatter,
    degrees_fit_model,
    cp_mode_fits_model,
    experts_fit_ep,
    expert_parallel_with_selective_op_checkpointing,
    expert_parallel_with_fullgraph_compile,
    attention_backend,
    pipeline_validation,
    fault_tolerance_layout,
    replica_launch,
)
