"""``lit-titan prepare``: token shards whose documents decode back exactly, deterministic for any worker
count, a no-op on the same input, and one line for each bad input (CPU, tiny corpora, BPE vocab 512)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lit_titan.cli.prepare import USER_ERRORS, main
from lit_titan.config import ConfigError
from lit_titan.data import build_tokenizer, load_corpus, split_corpus
from lit_titan.data.prepare import MANIFEST, TOKENIZER_FILE, read_manifest
from lit_titan.data.tokenizers import EOS_TOKEN

WORDS = "the quick brown fox jumps over a lazy dog while shards of tokens stream from disk to every rank".split()
CHUNK = 256  # tokens per chunk: several chunks per split, even per file


def _doc(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 .txt files (one document each) and 3 .jsonl files (one per line), with the awkward cases."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(8):
        (root / f"doc{i}.txt").write_text(_doc(rng, 120 + 40 * i))
    (root / "blank.txt").write_text("  \n\n")  # an empty document: no tokens, no EOS
    (root / "sub").mkdir()
    for i in range(3):
        lines = [json.dumps({"text": _doc(rng, 20 + 15 * j)}) for j in range(6)]
        lines += ["", json.dumps({"text": "   "}), json.dumps({"text": f"says {EOS_TOKEN} inside"})]
        (root / "sub" / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "notes.md").write_text("not a .txt/.jsonl file: ignored")
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def overrides(corpus: Path, cache: Path) -> list[str]:
    return ["data=text", f"data.path={corpus}", "model.vocab_size=512", f"data.data_dir={cache}"]


def run(corpus: Path, cache: Path, out: Path, *extra: str, chunk_tokens: int = CHUNK) -> dict:
    return main([*overrides(corpus, cache), f"out={out}", f"chunk_tokens={chunk_tokens}", *extra])


@pytest.fixture(scope="module")
def one_worker(corpus: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "w1"
    assert run(corpus, cache, out, "workers=1")["prepared"]
    return out


def stream(split_dir: Path) -> np.ndarray:
    """Every token of a split in index order, read straight from the chunk files."""
    index = json.loads((split_dir / "index.json").read_text())
    parts = []
    for chunk in index["chunks"]:
        raw = np.fromfile(split_dir / chunk["filename"], dtype=np.int32)
        parts.append(raw[int(chunk["chunk_size"]) + 2 :])  # header: item count + (items + 1) offsets
        assert parts[-1].size == chunk["dim"]
    return np.concatenate(parts)


def documents(tokens: np.ndarray, eos: int) -> list[list[int]]:
    assert tokens[-1] == eos, "the stream ends with a document's EOS"
    ends = np.flatnonzero(tokens == eos)
    return [tokens[a + 1 : b].tolist() for a, b in zip(np.r_[-1, ends[:-1]], ends)]


def test_documents_decode_back_and_counts_are_exact(one_worker: Path, corpus: Path, cache: Path) -> None:
    """Each document is tokenizer.encode(doc) + EOS, in file order; manifest counts equal a direct count."""
    m = read_manifest(one_worker)
    train, val = split_corpus(load_corpus("text", str(corpus), None), 0.02)
    assert val is not None and train.files and len(train.files) + len(val.files) == 12
    tok = build_tokenizer("bpe", None, 512, train, cache / "tokenizers")
    assert m["tokenizer"]["eos_id"] == tok.eos_id
    assert (one_worker / TOKENIZER_FILE).read_bytes() == tok.path.read_bytes()
    for name, split in (("train", train), ("val", val)):
        # the literal EOS text inside a document is dropped, so it cannot end the document early
        want = [[t for t in tok.encode(doc) if t != tok.eos_id] for doc in split.iter_texts()]
        got = documents(stream(one_worker / name), tok.eos_id)
        assert got == want
        assert m["splits"][name]["documents"] == len(want)
        assert m["splits"][name]["tokens"] == sum(len(d) + 1 for d in want)
        assert m["splits"][name]["chunks"] == len(list((one_worker / name).glob("chunk-*.bin")))
    assert m["splits"]["train"]["chunks"] > 1
    assert sum(EOS_TOKEN in d for d in train.iter_texts()) >= 1  # the case above is really in the data


def _chunk_hashes(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.glob("*/chunk-*.bin"))
    }


def test_worker_counts_same_tokens_deterministic_chunks(
    one_worker: Path, corpus: Path, cache: Path, tmp_path: Path
) -> None:
    """2 workers twice: byte-identical chunks; 1 vs 2 workers: the same token stream in index order."""
    a, b = tmp_path / "w2a", tmp_path / "w2b"
    run(corpus, cache, a, "workers=2")
    run(corpus, cache, b, "workers=2")
    assert _chunk_hashes(a) == _chunk_hashes(b) and _chunk_hashes(a)
    assert {p.name.split("-")[1] for p in (a / "train").glob("chunk-*.bin")} == {"0", "1"}  # both wrote chunks
    m1, m2 = read_manifest(one_worker), read_manifest(a)
    assert m1["splits"]["train"]["workers"] == 1 and m2["splits"]["train"]["workers"] == 2
    for split in ("train", "val"):
        assert np.array_equal(stream(one_worker / split), stream(a / split))
        assert {k: v for k, v in m1["splits"][split].items() if k not in ("workers", "chunks")} == {
            k: v for k, v in m2["splits"][split].items() if k not in ("workers", "chunks")
        }


def test_rerun_is_a_noop(
    one_worker: Path,
    corpus: Path,
    cache: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same input, any worker count: nothing tokenized, nothing trained, well under a second."""
    before = {p: p.stat().st_mtime_ns for p in one_worker.rglob("*")}
    start = time.process_time()
    result = run(corpus, cache, one_worker, "workers=2")
    cpu = time.process_time() - start
    # CPU time of this process (a loaded machine stretches wall time, not this); 0.1-0.2 s here. What
    # proves the no-op is below: no file of the directory rewritten, and (further down) no tokenizer trained.
    assert not result["prepared"] and cpu < 5.0, cpu
    assert "already prepared" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in one_worker.rglob("*")} == before

    # The tokenizer cache is gone (another machine, a cleaned ~/.cache): the BPE comes back from out/, untrained.
    own_cache = tmp_path / "cache"
    shutil.copytree(cache, own_cache)
    shutil.rmtree(own_cache / "tokenizers")
    import tokenizers.trainers

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the BPE was trained again")

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", no_training)
    assert not run(corpus, own_cache, one_worker)["prepared"]
    (restored,) = (own_cache / "tokenizers").glob("bpe-512-*/tokenizer.json")
    assert restored.read_bytes() == (one_worker / TOKENIZER_FILE).read_bytes()
    assert {p: p.stat().st_mtime_ns for p in one_worker.rglob("*")} == before


def test_changed_input_prepares_again(one_worker: Path, corpus: Path, cache: Path, tmp_path: Path) -> None:
    """A fixed tokenizer (hf: the one prepared above), so only the input files or the chunk size change."""
    root = tmp_path / "corpus"
    shutil.copytree(corpus, root)
    out = tmp_path / "out"
    hf = ["data.tokenizer.kind=hf", f"data.tokenizer.path={one_worker / TOKENIZER_FILE}", "workers=1"]
    first = run(root, cache, out, *hf)
    assert first["prepared"] and not run(root, cache, out, *hf)["prepared"]
    (root / "doc3.txt").write_text((root / "doc3.txt").read_text() + " and one more line")
    result = run(root, cache, out, *hf)
    assert result["prepared"] and result["manifest"]["tokenizer"] == first["manifest"]["tokenizer"]
    assert result["manifest"]["splits"]["train"]["tokens"] > first["manifest"]["splits"]["train"]["tokens"]
    assert run(root, cache, out, *hf, chunk_tokens=2 * CHUNK)["prepared"]  # the chunk size counts too
    assert run(root, cache, out, "model.vocab_size=400", "workers=1", chunk_tokens=2 * CHUNK)["prepared"]  # tokenizer


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "out=DIR is required"),
        (["out="], "out=DIR is required"),
        (["out=gs://bucket/prefix"], "only a local directory or s3://BUCKET/PREFIX"),
        (["out={out}", "out={out}"], "out= is given twice"),
        (["out={existing}"], "is not a prepared shard directory"),
        (["out={file}"], "is a file"),
        (["out={out}", "workers=0"], "workers=0: must be a positive integer"),
        (["out={out}", "workers=two"], "workers=two: must be a positive integer"),
        (["out={out}", "chunk_tokens=-4"], "chunk_tokens=-4: must be a positive integer"),
        (["out={out}", "data.path={missing}"], "data.path"),
        (["out={out}", "data.path={no_text}"], "no .txt/.jsonl documents there"),
        (
            ["out={out}", "data.path={content_key}"],
            r"a\.jsonl:1: records have no 'text' field \(this one has \['content'\]\); set data\.text_key=content ",
        ),
        (
            ["out={out}", "data.path={latin1}"],
            r"latin1\.txt: not utf-8 text at byte 3 \(invalid continuation byte\); set data\.encoding ",
        ),
        (["out={out}", "data.tokenizer.vocab_size=100"], "data.tokenizer.vocab_size"),
        (["out={out}", "+data.nonsense=1"], "data.nonsense=1: not a config key"),
    ],
)
def test_bad_input_is_one_line_before_any_work(args: list[str], message: str, corpus: Path, tmp_path: Path) -> None:
    paths = {
        "out": tmp_path / "out",
        "existing": tmp_path / "existing",
        "file": tmp_path / "a_file",
        "missing": tmp_path / "missing",
        "no_text": tmp_path / "no_text",
        "content_key": tmp_path / "content_key",
        "latin1": tmp_path / "latin1",
    }
    for folder in ("content_key", "latin1"):
        (tmp_path / folder).mkdir()
    (tmp_path / "content_key" / "a.jsonl").write_text(json.dumps({"content": "words " * 50}) + "\n")
    (tmp_path / "latin1" / "latin1.txt").write_bytes("café crème ".encode("latin-1") * 50)
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("mine")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "no_text").mkdir()
    (tmp_path / "no_text" / "readme.md").write_text("no .txt or .jsonl here")
    cache = tmp_path / "cache"
    argv = ["data=text", f"data.path={corpus}", "model.vocab_size=512", f"data.data_dir={cache}"]
    with pytest.raises(USER_ERRORS, match=message) as err:
        main(argv + [a.format(**paths) for a in args])
    assert "\n" not in str(err.value)
    assert not paths["out"].exists() and not cache.exists()  # nothing written, no tokenizer trained
    assert (tmp_path / "existing" / "keep.txt").read_text() == "mine"


def test_malformed_jsonl_is_one_line(one_worker: Path, tmp_path: Path) -> None:
    """Found up front (every line is parsed before the tokenizer or a worker starts): one line."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("a fine document " * 20)
    (root / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"b\.jsonl:2: not a JSON object") as err:
        main(
            [
                "data=text",
                f"data.path={root}",
                "data.val_fraction=0",
                "data.tokenizer.kind=hf",
                f"data.tokenizer.path={one_worker / TOKENIZER_FILE}",
                f"out={tmp_path / 'out'}",
                "workers=1",
            ]
        )
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_command_line(corpus: Path, tmp_path: Path) -> None:
    """``lit-titan prepare`` end to end: prepares, then says "already prepared"; bad input: one line, exit 2."""
    exe = Path(sys.executable).with_name("lit-titan")
    cmd = [
        str(exe) if exe.is_file() else sys.executable,
        *([] if exe.is_file() else ["-m", "lit_titan.cli"]),
        "prepare",
        *overrides(corpus, tmp_path / "cache"),
        f"out={tmp_path / 'out'}",
        "workers=2",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"prepared {tmp_path / 'out'} in ") and " documents" in first.stdout
    # stderr is a pipe, not a terminal: the plain "tokenizing" line, no progress bar and no escape codes
    assert "tokenizing" in first.stderr and "Progress" not in first.stderr and "\x1b" not in first.stderr
    assert (tmp_path / "out" / MANIFEST).is_file()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout.startswith("already prepared: "), again
    assert "Progress" not in again.stderr
    bad = subprocess.run([*cmd, "chunk_tokens=0"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2, bad
    assert bad.stderr.strip().splitlines() == ["lit-titan: error: chunk_tokens=0: must be a positive integer"]
    # A malformed .jsonl line found by a worker: one line, and no forked helper left holding our pipes
    # (litdata's own worker-error path leaves one, and this call would wait for it until the timeout).
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.txt").write_text("a fine document " * 20)
    (broken / "b.jsonl").write_text("{not json\n")
    cmd = [
        *cmd[: cmd.index("prepare") + 1],
        "data=text",
        f"data.path={broken}",
        "data.val_fraction=0",
        "data.tokenizer.kind=hf",
        f"data.tokenizer.path={tmp_path / 'out' / TOKENIZER_FILE}",
        f"out={tmp_path / 'out2'}",
    ]
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("lit-titan: error: "), bad
    assert "b.jsonl:1: not a JSON object" in bad.stderr
