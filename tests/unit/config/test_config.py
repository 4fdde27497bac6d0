"""Config composition and every bad-input case: clear errors before any expensive work."""

import json
import sys

import pytest

from lit_titan.config import ConfigError, compose, model_args, validate
from lit_titan.models.llama3 import FLAVORS
from lit_titan.strategies.parallel_dims import LayoutError, ParallelDims
from lit_titan.train import main

from helpers import TINY, run_job


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_every_flavor_composes(flavor):
    cfg = compose([f"model={flavor}"])
    args = model_args(cfg)
    assert cfg.model.name == flavor
    assert args == FLAVORS[flavor]  # the yaml adds nothing the flavor does not already say
    validate(cfg)


def test_documented_overrides_apply():
    cfg = compose(["trainer.max_steps=7", "data.seq_len=128", "data.global_batch_size=4", "seed=5",
                   "run_dir=/tmp/x", "precision=bf16-mixed", "logger=tensorboard", "model.n_layers=2"])
    assert (cfg.trainer.max_steps, cfg.data.seq_len, cfg.data.global_batch_size) == (7, 128, 4)
    assert (cfg.seed, cfg.data.seed, cfg.run_dir, cfg.precision) == (5, 5, "/tmp/x", "bf16-mixed")
    assert list(cfg.logger) == ["tensorboard"] and cfg.optim.total_steps == 7
    assert cfg.logger.tensorboard._target_ == "lightning.pytorch.loggers.TensorBoardLogger"
    assert model_args(cfg).n_layers == 2


@pytest.mark.parametrize("overrides, error, needle", [
    (["model=llama3_7b"], ConfigError, "llama3_debug"),
    (["logger=mlflow"], ConfigError, "logger"),
    (["precision=16-mixed"], ConfigError, "precision"),
    (["data.seq_len=4096"], ConfigError, "data.seq_len"),
    (["data.seq_len=0"], ConfigError, "data.seq_len"),
    (["cluster.devices=4", "parallel.dp_shard=3"], LayoutError, "cluster.devices"),
    (["cluster.devices=6", "parallel.tp=4"], LayoutError, "world size"),
    (["cluster.devices=4", "parallel.tp=4", "model.n_kv_heads=2", "model.n_heads=4", "model.dim=64"],
     LayoutError, "n_kv_heads"),
    (["cluster.devices=2", "parallel.tp=2", "data.seq_len=33"], LayoutError, "data.seq_len"),
    (["cluster.devices=4", "parallel.cp=2", "data.seq_len=34"], LayoutError, "2*cp*tp"),
    (["cluster.devices=4", "data.global_batch_size=6"], LayoutError, "data.global_batch_size"),
    (["cluster.devices=2", "data.global_batch_size=8", "data.micro_batch_size=3"], LayoutError, "micro_batch_size"),
])
def test_bad_config_is_refused_before_work(overrides, error, needle):
    with pytest.raises(error, match=needle.replace("*", r"\*").replace(".", r"\.")):
        validate(compose(overrides))


@pytest.mark.parametrize("overrides, needle", [
    (["data=text", "data.path=/nonexistent/corpus"], "data.path"),
    (["data.tokenizer.kind=hf", "data.tokenizer.path=/nonexistent/tokenizer.json"], "tokenizer"),
    (["model.vocab_size=512", "data.tokenizer.vocab_size=1024"], "vocab"),
])
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
        [sys.executable, "-m", "lit_titan.train", "cluster.devices=2", "parallel.tp=3", f"run_dir={tmp_path}"], timeout=120,
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
