"""Config composition and every bad-input case: clear errors before any expensive work."""

import json
import sys

import pytest

from helpers import TINY, run_job
from lit_titan.config import ConfigError, compose, validate
from lit_titan.config.spec import model_args
from lit_titan.models.llama3 import FLAVORS
from lit_titan.strategies.parallel_dims import LayoutError, ParallelDims
from lit_titan.train import main


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_every_flavor_composes(flavor):
    cfg = compose([f"model={flavor}"])
    args = model_args(cfg)
    assert cfg.model.name == flavor
    assert args == FLAVORS[flavor]  # the yaml adds nothing the flavor does not already say
    validate(cfg)


def test_documented_overrides_apply():
    cfg = compose(
        [
            "trainer.max_steps=7",
            "data.seq_len=128",
            "data.global_batch_size=4",
            "seed=5",
            "run_dir=/tmp/x",
            "precision=bf16-mixed",
            "logger=tensorboard",
            "model.n_layers=2",
        ]
    )
    assert (cfg.trainer.max_steps, cfg.data.seq_len, cfg.data.global_batch_size) == (7, 128, 4)
    assert (cfg.seed, cfg.data.seed, cfg.run_dir, cfg.precision) == (5, 5, "/tmp/x", "bf16-mixed")
    assert list(cfg.logger) == ["tensorboard"] and cfg.optim.total_steps == 7
    assert cfg.logger.tensorboard._target_ == "lightning.pytorch.loggers.TensorBoardLogger"
    assert model_args(cfg).n_layers == 2


@pytest.mark.parametrize(
    "overrides, error, needle",
    [
        (["model=llama3_7b"], ConfigError, "llama3_debug"),
        (["logger=mlflow"], ConfigError, "logger"),
        (["precision=16-mixed"], ConfigError, "precision"),
        (["data.seq_len=4096"], ConfigError, "data.seq_len"),
        (["data.seq_len=0"], ConfigError, "data.seq_len"),
        (["cluster.devices=4", "parallel.dp_shard=3"], LayoutError, "cluster.devices"),
        (["cluster.devices=6", "parallel.tp=4"], LayoutError, "world size"),
        (
            ["cluster.devices=4", "parallel.tp=4", "model.n_kv_heads=2", "model.n_heads=4", "model.dim=64"],
            LayoutError,
            "n_kv_heads",
        ),
        (["cluster.devices=2", "parallel.tp=2", "data.seq_len=33"], LayoutError, "data.seq_len"),
        (["cluster.devices=4", "parallel.cp=2", "data.seq_len=34"], LayoutError, "2*cp*tp"),
        (["cluster.devices=4", "data.global_batch_size=6"], ConfigError, "data.global_batch_size"),
        (["cluster.devices=2", "data.global_batch_size=8", "data.micro_batch_size=3"], ConfigError, "micro_batch_size"),
        (
            ["cluster.devices=4", "parallel.tp=2", "parallel.ep=4"],
            LayoutError,
            "parallel.ep=4: expert parallel borrows",
        ),
        (["cluster.devices=2", "parallel.ep=2"], LayoutError, "parallel.ep=2: the model has no routed experts"),
        (
            ["model=qwen3_moe_debug", "cluster.devices=6", "data.global_batch_size=12", "parallel.ep=3"],
            LayoutError,
            "parallel.ep=3: does not divide the model's 8 experts",
        ),
        (
            ["model=qwen3_moe_debug", "cluster.devices=2", "parallel.ep=2", "callbacks=[activation_checkpointing]"],
            ConfigError,
            "callbacks.activation_checkpointing.mode=selective_op: not supported with parallel.ep=2",
        ),
        (
            ["model=qwen3_moe_debug", "cluster.devices=2", "parallel.ep=2", "callbacks=[compile]"],
            ConfigError,
            "callbacks.compile.fullgraph=true: not supported with parallel.ep=2",
        ),
    ],
)
def test_bad_config_is_refused_before_work(overrides, error, needle):
    with pytest.raises(error, match=needle.replace("*", r"\*").replace(".", r"\.")):
        validate(compose(overrides))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["data=text", "data.path=/nonexistent/corpus"], "data.path"),
        (["data.tokenizer.kind=hf", "data.tokenizer.path=/nonexistent/tokenizer.json"], "tokenizer"),
        (["model.vocab_size=512", "data.tokenizer.vocab_size=1024"], "vocab"),
    ],
)
def test_bad_data_inputs_fail_before_training(overrides, needle, tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match=needle):
        main([*TINY, *overrides, f"run_dir={tmp_path}"])
    assert not (tmp_path / "metrics.csv").exists()


def test_empty_corpus_is_refused(tmp_path):
    empty = tmp_path / "corpus"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    with pytest.raises(ValueError, match="data.path"):
        main([*TINY, "data=text", f"data.path={empty}", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=1"])


def test_corpus_smaller_than_one_batch_is_refused(tmp_path):
    small = tmp_path / "corpus"
    small.mkdir()
    (small / "one.txt").write_text("a few words only")
    with pytest.raises(ValueError, match="fewer than one global batch"):
        main([*TINY, "data=text", f"data.path={small}", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=1"])


def test_cli_reports_errors_in_one_line_without_starting_processes(tmp_path):
    proc = run_job(
        [sys.executable, "-m", "lit_titan.train", "cluster.devices=2", "parallel.tp=3", f"run_dir={tmp_path}"],
        timeout=120,
    )
    assert proc.returncode == 2
    assert "lit-titan: error:" in proc.stderr and "Traceback" not in proc.stderr
    assert "distributed_backend" not in proc.stdout + proc.stderr  # no process group was created
    assert not (tmp_path / "config.yaml").exists()


def test_dp_rank_mapping_without_process_groups():
    dims = ParallelDims.resolve(8, pp=2, dp_shard=2, tp=2)
    assert dims.shape == (2, 1, 2, 1, 2)
    # tp innermost: ranks 0,1 are tp peers (same dp index); 0 and 2 differ in dp_shard.
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert dims.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert json.dumps(dims.as_dict())


def test_expert_parallel_borrows_its_ranks_from_dp_shard_x_cp():
    dims = ParallelDims.resolve(16, pp=2, dp_shard=2, cp=2, tp=2, ep=2)
    assert (dims.fsdp_size, dims.ep, dims.efsdp) == (4, 2, 2)
    dims.validate_experts(8)
    with pytest.raises(LayoutError, match=r"use parallel\.ep in \[1, 2, 4\]"):
        ParallelDims.resolve(16, pp=2, dp_shard=2, cp=2, tp=2, ep=3)
    with pytest.raises(LayoutError, match=r"the model's 9 experts; use parallel\.ep in \[1\]"):
        dims.validate_experts(9)
    with pytest.raises(LayoutError, match="no routed experts"):
        dims.validate_experts(None)
    # with tp the experts are split over ep x tp
    with pytest.raises(
        LayoutError, match=r"ep x tp = 4 ranks, which does not divide the model's 6 experts; use parallel\.ep in \[1\]"
    ):
        dims.validate_experts(6)


def test_the_train_command_checks_its_config_once(tmp_path, monkeypatch):
    """One check of the config, one resolution of the degrees and one look at the inputs per run: the
    command's app validates and hands the JobSpec on (train() used to validate again and the strategy
    to resolve the degrees a third time). The functions are wrapped to count calls, not replaced."""
    import collections

    from lit_titan.cli import hydra_app
    from lit_titan.config import inputs, spec
    from lit_titan.config.compose import RUN_DIR_ENV

    counts: collections.Counter = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(spec, "check_schema", counted("schema", spec.check_schema))
    monkeypatch.setattr(spec, "_build", counted("rules", spec._build))
    monkeypatch.setattr(hydra_app, "check_inputs", counted("inputs", hydra_app.check_inputs))
    monkeypatch.setattr(inputs, "check_inputs", counted("inputs", inputs.check_inputs))
    resolve = ParallelDims.resolve.__func__
    monkeypatch.setattr(ParallelDims, "resolve", classmethod(counted("degrees", resolve)))
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))  # restored afterwards: main() exports it
    summary = main(
        [*TINY, "trainer.max_steps=1", "checkpoint.enabled=false", "data.micro_batch_size=4", f"run_dir={tmp_path}"]
    )
    assert summary and (tmp_path / "metrics.csv").is_file()
    assert counts == {"schema": 1, "rules": 1, "degrees": 1, "inputs": 1}, counts


def test_one_error_line_formatter():
    """lit_titan.errors holds the one formatter every layer's message goes through, and the kinds of bad input."""
    from lit_titan.checkpoint.layout import CheckpointError
    from lit_titan.cli.export import ExportError
    from lit_titan.errors import UserError, error_line, keyed_line, one_line

    assert one_line("first\n  second   part\n\nthird.") == "first; second part; third."
    assert one_line("Could not override 'x'.\nTo append use +x=1") == "Could not override 'x'. To append use +x=1"
    assert one_line(OSError("disk\nfull"), with_type=True) == "OSError: disk; full"
    assert one_line(RuntimeError(), with_type=True) == "RuntimeError"
    assert keyed_line("parallel.tp=3 must divide n_heads") == "parallel.tp=3: must divide n_heads"
    assert keyed_line("data.path=x: no such file") == "data.path=x: no such file"
    assert (
        error_line("parallel.tp=3 must divide\nn_heads=4") == "lit-titan: error: parallel.tp=3: must divide; n_heads=4"
    )
    assert all(issubclass(k, UserError) for k in (ConfigError, LayoutError, CheckpointError, ExportError))
