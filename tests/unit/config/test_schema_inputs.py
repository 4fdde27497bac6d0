"""The classes of bad input, each one line before any rank, directory or model exists.

In-process through ``lit_titan.train.main`` (the function the CLI runs: Hydra app -> check -> validate
-> schema_inputs) for the data and tokenizer classes; a few through the real command line (exit code 2,
one stderr line, no traceback) for each entry point, HYDRA_FULL_ERROR=1 and a non-zero rank.
"""

from __future__ import annotations

import os
import sys

import pytest

from helpers import TINY, run_job
from lit_titan.config import ConfigError
from lit_titan.train import main
from paths import SCRIPTS

ERROR = "lit-titan: error: "


def _hf_tokenizer(path, n_tokens: int):
    """A real tokenizer.json (tokenizers' WordLevel) with ``n_tokens`` entries, end-of-text included."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|end_of_text|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(n_tokens - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _refused(tmp_path, overrides, starts):
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        main([*TINY, "trainer.max_steps=1", *overrides, f"run_dir={run}"])
    line = str(info.value)
    assert line.startswith(starts) and "\n" not in line and "; " in line, line
    assert not run.exists()  # refused before Hydra made the run directory
    return line


def test_empty_data_directory(tmp_path):
    (tmp_path / "docs").mkdir()
    _refused(
        tmp_path,
        ["data=text", f"data.path={tmp_path / 'docs'}"],
        f"data.path={tmp_path / 'docs'}: no .txt/.jsonl documents there; ",
    )


def test_missing_data_directory(tmp_path):
    _refused(tmp_path, ["data=text", f"data.path={tmp_path / 'nope'}"], f"data.path={tmp_path / 'nope'}: no such")


def test_binary_file_in_the_corpus(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.txt").write_text("words " * 5000)
    (docs / "model.txt").write_bytes(bytes(range(256)) * 40)
    line = _refused(tmp_path, ["data=text", f"data.path={docs}"], f"data.path={docs}: ")
    assert "model.txt is a binary file" in line


def test_malformed_jsonl_line_anywhere_in_the_corpus(tmp_path):
    """Every line is parsed before any rank: a bad line deep in a validation file is one line, not a rank's traceback."""
    import json

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("words " * 5000)
    (docs / "b.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(5)) + "{oops\n")
    line = _refused(tmp_path, ["data=text", f"data.path={docs}", "data.val_fraction=0.5"], f"data.path={docs}: ")
    assert line.endswith(
        f"{docs / 'b.jsonl'}:6: not a JSON object with a 'text' field (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)); fix or remove that line"
    ), line


def test_jsonl_records_without_the_text_key_name_the_key_to_set(tmp_path):
    import json

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.jsonl").write_text("".join(json.dumps({"id": i, "content": "words " * 300}) + "\n" for i in range(9)))
    line = _refused(tmp_path, ["data=text", f"data.path={docs}"], f"data.path={docs}: ")
    assert line.endswith(
        f"{docs / 'a.jsonl'}:1: records have no 'text' field (this one has ['content', 'id']); "
        "set data.text_key=content to the field that holds the text"
    ), line


def test_text_not_in_the_encoding_is_refused_at_its_byte(tmp_path):
    """A Latin-1 file anywhere in the corpus (not only the first read) is one line, never replacement characters."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("words " * 5000)
    (docs / "b.txt").write_bytes("plain words, then café ".encode("latin-1") * 100)
    line = _refused(tmp_path, ["data=text", f"data.path={docs}", "data.val_fraction=0"], f"data.path={docs}: ")
    assert line.endswith(
        f"{docs / 'b.txt'}: not utf-8 text at byte 21 (invalid continuation byte); set data.encoding to the "
        "files' encoding (e.g. data.encoding=latin-1) or convert them to utf-8"
    ), line


def test_corpus_smaller_than_one_global_batch(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("a few words only")
    line = _refused(tmp_path, ["data=text", f"data.path={docs}", "data.val_fraction=0"], f"data.path={docs}: ")
    assert "fewer than one global batch" in line and "= 257" in line  # 8 x 32 + 1 tokens


def test_tokenizer_file_that_is_not_json(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("this is not json")
    _refused(
        tmp_path,
        ["data.tokenizer.kind=hf", f"data.tokenizer.path={bad}"],
        f"data.tokenizer.path={bad}: not a tokenizer.json",
    )


def test_tokenizer_larger_than_the_models_vocabulary(tmp_path):
    tok = _hf_tokenizer(tmp_path / "tokenizer.json", 600)  # TINY's model.vocab_size is 512
    line = _refused(tmp_path, ["data.tokenizer.kind=hf", f"data.tokenizer.path={tok}"], f"data.tokenizer.path={tok}: ")
    assert "600 tokens" in line and "model.vocab_size=512" in line


def test_float8_without_fp8_units(tmp_path):
    _refused(tmp_path, ["callbacks=[float8]"], "callbacks.float8.emulate=false: Float8 needs FP8 units")


def test_prepared_directory_without_manifest(tmp_path):
    (tmp_path / "shards").mkdir()
    _refused(
        tmp_path, ["data=tokens", f"data.path={tmp_path / 'shards'}"], f"data.path={tmp_path / 'shards'}: no manifest"
    )


# ---- the real command line ------------------------------------------------------------------------------
def _cli(args, tmp_path, env=None):
    proc = run_job([sys.executable, "-m", *args], timeout=300, cwd=tmp_path, env=env)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()], proc


@pytest.mark.parametrize(
    "args, starts",
    [
        (["lit_titan.train", "trainer.max_steps=ten"], "trainer.max_steps=ten: wrong type"),  # class 1: wrong type
        (["lit_titan.train", "checkpoint.keep_last=-1"], "checkpoint.keep_last=-1: out of range"),  # class 2: range
        (["lit_titan.train", "run_dir=/proc/lit-titan-run"], "run_dir=/proc/lit-titan-run: cannot write"),  # class 5
        (["lit_titan.cli", "plan", "optim.betas=[0.9]"], "optim.betas=[0.9]: not two numbers"),
        (["lit_titan.cli", "prepare", "data=text", "data.path=nowhere", "out=out"], "data.path=nowhere: no such"),
    ],
)
def test_cli_one_line_and_exit_code_2(args, starts, tmp_path):
    code, lines, proc = _cli(args, tmp_path)
    assert code == 2 and lines == [ERROR + lines[0][len(ERROR) :]] and lines[0].startswith(ERROR + starts), proc.stderr[
        -3000:
    ]
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_cli_hydra_full_error_shows_the_traceback_and_other_ranks_stay_quiet(tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    code, lines, proc = _cli(["lit_titan.train", "optim.lr=-1"], tmp_path, env=env)
    assert code != 0 and "Traceback" in proc.stderr and "optim.lr=-1: out of range" in proc.stderr


@pytest.mark.slow
def test_under_torchrun_only_the_first_rank_prints(tmp_path):
    code, lines, proc = _cli(
        [
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--no-python",
            sys.executable,
            "-m",
            "lit_titan.train",
            "cluster.devices=2",
            "data.num_workers=-1",
        ],
        tmp_path,
    )
    ours = [line for line in lines if line.startswith(ERROR)]
    assert ours == [ERROR + "data.num_workers=-1: out of range; use a value >= 0"], proc.stderr[-3000:]


@pytest.mark.slow
def test_a_runtime_failure_on_one_rank_is_one_line_naming_the_rank_and_its_log(tmp_path):
    script = str(SCRIPTS / "rank_failure.py")
    proc = run_job(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script], timeout=300, cwd=tmp_path
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]
    log = tmp_path / "logs" / "rank-1-error.txt"
    assert proc.returncode != 0 and ours == [
        f"{ERROR}rank 1 failed: RuntimeError: simulated failure on this rank (e.g. an I/O error); full traceback "
        f"in {log}"
    ], proc.stderr[-3000:]
    assert 'raise RuntimeError("simulated failure' in log.read_text()
    assert 'raise RuntimeError("simulated failure' not in proc.stderr  # no traceback of the rank on the console


def test_a_finished_rank_exits_with_its_code_after_its_exit_handlers(tmp_path):
    """``cli.exit_rank``: a launched rank skips interpreter teardown (where torch's cached gloo groups
    could abort it), but an idle thread pool is stopped, a non-daemon thread joined, atexit handlers
    run and the exit code is kept."""
    script = tmp_path / "rank.py"
    script.write_text(f"""
import atexit, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from lit_titan.job.ranks import exit_rank
out = Path({str(tmp_path)!r})
atexit.register(lambda: (out / "atexit").write_text("ran"))
pool = ThreadPoolExecutor(1); pool.submit(lambda: None).result()  # an idle worker thread: must not hang the exit
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("joined"))).start()
exit_rank(3)
(out / "after").write_text("not reached")
""")
    proc = run_job([sys.executable, str(script)], timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
    assert not (tmp_path / "after").exists()
