"""Preemption: a real SIGTERM to the launcher or to one rank saves the interrupted step, says one line and exits
with the requeue code; ``resume=auto`` then ends with the weights of an uninterrupted run.

Real processes and real signals (command lines); the uninterrupted reference and the resumed runs use the
reused gloo worlds. The signal arrives at a known step: ``fault.pause`` holds the drilled rank at
``fault.at_step`` (printing its pid) until a signal comes, however loaded the machine is.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers import TINY, _kill_group, final_params, start_job
from lit_titan.checkpoint import published, validate
from lit_titan.errors import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.slow

STEPS, AT = 8, 3
COMMON = [
    *TINY,
    f"trainer.max_steps={STEPS}",
    "seed=0",
    "precision=32-true",
    "trainer.deterministic=true",
    "checkpoint.keep_last=0",
    "cluster.devices=2",
]
PAUSE = [f"fault.at_step={AT}", "fault.pause=true"]
_PAUSED = re.compile(r"fault injection: rank (\d+) \(pid (\d+)\) paused")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worlds) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("reference")
    worlds.train(COMMON, run_dir)
    return final_params(run_dir)


def signal_when_paused(cmd: list[str], to_launcher: bool, signum: int = signal.SIGTERM, timeout: int = 500):
    """Start ``cmd``; when the drilled rank says it paused, send ``signum`` (to the launcher's pid, or to the
    paused rank's own pid); return the finished job and the pid signalled."""
    job = start_job(cmd)
    popen = job._popen
    timer = threading.Timer(timeout, _kill_group, (popen.pid,))  # a hang fails the test instead of blocking it
    timer.start()
    head, target = [], None
    try:
        for line in popen.stderr:
            head.append(line)
            match = _PAUSED.search(line)
            if match:
                target = popen.pid if to_launcher else int(match.group(2))
                os.kill(target, signum)
                break
        proc = job.wait(timeout)
    finally:
        timer.cancel()
    proc.stderr = "".join(head) + proc.stderr
    assert target is not None, f"the drilled rank never paused:\n{proc.stderr[-5000:]}"
    return proc, target


def assert_saved_and_said(proc, run_dir: Path, launcher: str) -> None:
    assert proc.returncode == REQUEUE_EXIT_CODE, (proc.returncode, proc.stderr[-5000:])
    lines = [ln for ln in proc.stderr.splitlines() if "lit-titan: preempted" in ln]
    assert len(lines) == 1, proc.stderr[-5000:]  # one line, rank 0's
    ckpt = run_dir / "checkpoints" / f"step-{AT:06d}"
    assert f"saved the checkpoint of step {AT} in {ckpt}" in lines[0] and "resume=auto" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    assert [p.name for p in published(run_dir / "checkpoints")] == [ckpt.name], launcher  # the interrupted step
    validate(ckpt)


@pytest.mark.parametrize("to_launcher", [True, False], ids=["sigterm-to-launcher", "sigterm-to-rank-1"])
def test_sigterm_saves_the_step_and_exits_for_requeue(reference, tmp_path, worlds, to_launcher):
    rank = 0 if to_launcher else 1
    cmd = [sys.executable, "-m", "lit_titan.train", *COMMON, *PAUSE, f"fault.kill_rank={rank}", f"run_dir={tmp_path}"]
    proc, _ = signal_when_paused(cmd, to_launcher)
    assert_saved_and_said(proc, tmp_path, "lightning")
    assert f"SIGTERM on rank {rank}" in proc.stderr
    worlds.train([*COMMON, "resume=auto"], tmp_path)
    got = final_params(tmp_path)
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in reference), "resumed weights differ from the reference"


def test_torchrun_requeues_a_preempted_rank_and_finishes(reference, tmp_path):
    """torchrun reads the requeue code as a failed attempt: it restarts the workers, which resume and finish."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        "-m",
        "lit_titan.train",
        *COMMON,
        *PAUSE,
        "fault.kill_rank=1",
        "resume=auto",
        f"run_dir={tmp_path}",
    ]
    proc, _ = signal_when_paused(cmd, to_launcher=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "preempted (SIGTERM on rank 1): saved the checkpoint of step 3" in proc.stderr, proc.stderr[-5000:]
    assert f"resuming from {tmp_path / 'checkpoints' / f'step-{AT:06d}'}" in proc.stderr, proc.stderr[-5000:]
    got = final_params(tmp_path)
    assert all(torch.equal(got[k], reference[k]) for k in reference), "resumed weights differ from the reference"


def test_s3_outage_retries_then_saves_and_exits_for_requeue(tmp_path):
    """The S3 server stops mid-run: the reader retries (bounded), then every rank saves and the job exits
    with the one line and the requeue code; the advice is to continue, not to change AWS_ENDPOINT_URL."""
    import boto3

    from helpers import synthetic_corpus
    from lit_titan.data import prepare_shards, split_corpus, text_corpus
    from lit_titan.data.remote import OUTAGE_ENV, upload_dir
    from lit_titan.data.tokenizers import train_bpe_tokenizer
    from s3server import S3Server, start_moto

    corpus = text_corpus(synthetic_corpus(tmp_path / "docs", 120, 300, seed=5))
    train, val = split_corpus(corpus, 0.05)
    prepare_shards(
        train, val, train_bpe_tokenizer(corpus, 512, tmp_path / "tok"), tmp_path / "local", chunk_tokens=256
    )  # about one new chunk per step: every step reads from the server
    server_proc, endpoint = start_moto(tmp_path / "moto.log")  # its own server: this test stops it
    try:
        server = S3Server(endpoint, bucket="outage")
        boto3.client("s3", **server.storage_options()).create_bucket(Bucket=server.bucket)
        url = server.url()
        upload_dir(tmp_path / "local", url, server.storage_options())
        options = ",".join(f"{k}:'{v}'" for k, v in server.storage_options().items())
        run_dir = tmp_path / "run"
        cmd = [
            sys.executable,
            "-m",
            "lit_titan.train",
            *COMMON,
            "data=tokens",
            "model.vocab_size=512",
            f"data.path={url}",
            f"data.storage_options={{{options}}}",
            f"data.data_dir={tmp_path / 'cache'}",
            "fault.kill_rank=0",
            "fault.at_step=2",
            "fault.pause=true",
            f"run_dir={run_dir}",
        ]
        job = start_job(cmd, env={**os.environ, OUTAGE_ENV: "4"})
        popen, head = job._popen, []
        timer = threading.Timer(500, _kill_group, (popen.pid,))
        timer.start()
        try:
            for line in popen.stderr:
                head.append(line)
                match = _PAUSED.search(line)
                if match:
                    server_proc.terminate()
                    server_proc.wait(timeout=30)
                    os.kill(int(match.group(2)), signal.SIGCONT)  # go on, with the server gone
                    break
            proc = job.wait(500)
        finally:
            timer.cancel()
    finally:
        server_proc.kill()
        server_proc.wait()
    stderr = "".join(head) + proc.stderr
    assert proc.returncode == REQUEUE_EXIT_CODE, (proc.returncode, stderr[-5000:])
    lines = [ln for ln in stderr.splitlines() if "data store outage" in ln]
    assert len(lines) == 1, stderr[-5000:]
    match = re.search(
        rf"the S3 endpoint {re.escape(endpoint)} stopped answering mid-run .*attempts over \d+ s\): "
        r"saved the checkpoint of step (\d+) in ",
        lines[0],
    )
    assert match and "resume=auto" in lines[0], lines[0]
    step = int(match.group(1))
    assert step >= 2 and (run_dir / "checkpoints" / f"step-{step:06d}") in published(run_dir / "checkpoints")
    validate(run_dir / "checkpoints" / f"step-{step:06d}")
    assert "AWS_ENDPOINT_URL" not in stderr and "Traceback" not in stderr, stderr[-5000:]
