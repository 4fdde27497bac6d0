"""Credentials stay out of every file a run writes and of what it prints; prepare writes straight to S3.

One real command line (Hydra writes its records only there) on the loopback S3 server
(tests/support/s3server.py): the shards come from ``lit-titan prepare out=s3://...``, the run reads them
with credentials in ``data.storage_options`` and a W&B setting holding a token, from a run_dir whose
name needs shell quoting, and the printed continue command must round-trip through the shell.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from helpers import TINY, losses, run_job

# Strings that cannot appear in a file or a log by accident.
SECRET = f"ltsecret{uuid.uuid4().hex}"
TOKEN = f"lttok{uuid.uuid4().hex}"[:40]  # W&B keys are 40 characters


def test_prepare_to_s3_then_credentials_appear_in_no_file_and_no_output(
    tmp_path: Path, s3_server: Any, monkeypatch: Any
) -> None:
    from lit_titan.cli.prepare import main as prepare

    # prepare out=s3://: credentials from the environment, as docs/data.md recommends
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    url = s3_server.url()
    result = prepare(
        [
            "data.max_bytes=300000",
            "model.vocab_size=512",
            f"data.data_dir={tmp_path / 'cache'}",
            f"out={url}",
            "workers=1",
            "chunk_tokens=4096",
        ]
    )
    assert result["out"] == url and result["prepared"]

    run_dir = tmp_path / "my run $HOME"  # a space and a $: the printed commands must quote them
    options = {**s3_server.storage_options(), "aws_secret_access_key": SECRET}  # moto accepts any key
    overrides = [
        *TINY,
        "trainer.max_steps=2",
        "data=tokens",
        f"data.path={url}",
        "data.storage_options={" + ",".join(f"{k}:'{v}'" for k, v in options.items()) + "}",
        f"data.data_dir={tmp_path / 'cache'}",
        "logger=[csv]",
        # a user's own logger settings (a target the schema does not check): W&B, given a token
        "+logger.wb._target_=lightning.pytorch.loggers.wandb.WandbLogger",
        "+logger.wb.save_dir=${run_dir}",
        "+logger.wb.offline=true",
        f"+logger.wb.settings.api_key={TOKEN}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WANDB_"))}  # the options, not the env
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
    )
    proc = run_job([sys.executable, "-m", "lit_titan.train", *overrides, f"run_dir={run_dir}"], env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert len(losses(run_dir)) == 2  # it trained, reading the shards with those credentials
    assert list(run_dir.glob("wandb/*/*.wandb"))  # W&B wrote its log (checked below)

    from lit_titan.report import make_report

    make_report(run_dir)  # report.html, the page people share: under the same check
    for secret in (SECRET, TOKEN):
        assert secret not in out, [line for line in out.splitlines() if secret in line]
        leaked = [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        assert leaked == [], (secret, leaked)

    # Hydra's record is there, redacted; the records are the user's only
    record = run_dir / ".hydra"
    assert sorted(p.name for p in record.iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    cfg = yaml.safe_load((record / "config.yaml").read_text())
    assert cfg["data"]["storage_options"]["aws_secret_access_key"] == "***"
    assert cfg["data"]["storage_options"]["endpoint_url"] == s3_server.endpoint_url  # only credentials hidden
    assert yaml.safe_load((record / "hydra.yaml").read_text())["hydra"]["output_subdir"] == ".hydra"
    assert f"data.path={url}" in yaml.safe_load((record / "overrides.yaml").read_text())
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["logger"]["wb"]["settings"]["api_key"] == "***"
    assert stat.S_IMODE(record.stat().st_mode) == 0o700
    for path in (run_dir / "config.yaml", *record.iterdir()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    # the printed commands: shell-quoted (run_dir round-trips), credentials as *** with advice
    found = re.findall(r"^lit-titan: train 2 more steps from the last checkpoint: (.+)$", out, re.M)
    assert len(found) == 1, out[-3000:]
    argv = shlex.split(found[0])
    assert f"run_dir={run_dir}" in argv and any("aws_secret_access_key:'***'" in a for a in argv), argv
    assert "lit-titan: credentials are shown as ***" in out
    report = re.search(r"^lit-titan: see the metrics: (.+?)  \(writes", out, re.M)
    assert report and shlex.split(report.group(1)) == ["lit-titan", "report", str(run_dir)]


def test_what_is_secret_and_printed_commands_round_trip_through_the_shell(monkeypatch: Any, tmp_path: Path) -> None:
    """The redaction rules (lit_titan/observe/redact.py), error lines, and shell quoting of the end-of-run lines."""
    from lit_titan.callbacks import RunSummary
    from lit_titan.job.ranks import scrub
    from lit_titan.observe.redact import is_secret_key, redact, secrets_of

    secret = [
        "aws_secret_access_key",
        "aws_access_key_id",
        "aws_session_token",
        "key",
        "api_key",
        "hf_token",
        "password",
        "WANDB_API_KEY",
        "credentials_file",
        "auth",
    ]
    plain = ["chunk_tokens", "tokenizer", "endpoint_url", "region_name", "tokens", "keys", "monkey", "path"]
    assert [k for k in secret + plain if is_secret_key(k)] == secret

    line = f"data.storage_options={{endpoint_url:'http://h:1',aws_secret_access_key:'{SECRET}'}}"
    mixture = f"data.sources=[{{path: s3://b/p, weight: 1, storage_options: {{aws_session_token: {TOKEN}}}}}]"
    assert secrets_of([line, mixture, "seed=1"]) == {SECRET, TOKEN}
    assert redact([line, mixture]) == [
        "data.storage_options={endpoint_url:'http://h:1',aws_secret_access_key:'***'}",
        "data.sources=[{path: s3://b/p, weight: 1, storage_options: {aws_session_token: ***}}]",
    ]
    cfg = {
        "data": {"storage_options": {"aws_secret_access_key": SECRET, "endpoint_url": "http://h:1"}},
        "note": f"x{SECRET}y",
    }
    assert redact(cfg) == {
        "data": {"storage_options": {"aws_secret_access_key": "***", "endpoint_url": "http://h:1"}},
        "note": "x***y",
    }
    monkeypatch.setattr(sys, "argv", ["lit_titan.train", line])
    assert scrub(f"{line}: not a config key") == (  # error lines too
        "data.storage_options={endpoint_url:'http://h:1',aws_secret_access_key:'***'}: not a config key"
    )

    run_dir = str(tmp_path / "my run $HOME")
    (tmp_path / "my run $HOME" / "tensorboard").mkdir(parents=True)  # the summary names only outputs that exist
    summary = RunSummary(
        run_dir, continue_command="python -m lit_titan.train 'x=***'", tensorboard_dir=f"{run_dir}/tensorboard"
    )
    summary.summary = {"steps": 3, "tokens": 96, "final_loss": 8.7, "tokens_per_second": 1.0, "train_seconds": 1.0}
    lines = summary.lines()
    report = next(s for s in lines if "see the metrics" in s).split(": ", 2)[2].split("  (")[0]
    assert shlex.split(report) == ["lit-titan", "report", run_dir]
    board = next(s for s in lines if "TensorBoard" in s).split(": ", 2)[2]
    assert shlex.split(board) == ["tensorboard", "--logdir", f"{run_dir}/tensorboard"]
    assert any(s.startswith("lit-titan: credentials are shown as ***") for s in lines)
