"""Where a run's tokens come from: prepared shard directories (local or S3), checked up front.

``data.corpus=stdlib|text`` documents are prepared into the cache on first use
(``prepare.py``); ``tokens`` names one prepared directory, ``mixture`` several with weights.
Everything here runs before any process group: a missing manifest, a tokenizer that does not
match, an unreachable endpoint, a bad weight or an empty source is one line naming the setting.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_titan.data.shards import ShardSplit, is_remote, load_manifest, read_text, tokenizer_path
from lit_titan.data.tokenizers import HFTokenizer, Tokenizer, tokenizer_fingerprint
from lit_titan.errors import ConfigError


@dataclass
class Source:
    """One prepared directory and its weight; ``setting`` names it in error messages."""

    path: str
    weight: float
    setting: str
    manifest: dict[str, Any]
    storage_options: dict | None = None

    @property
    def name(self) -> str:
        return Path(str(self.path).rstrip("/")).name or str(self.path)

    def split(self, split: str, cache_dir: Path) -> ShardSplit | None:
        if split not in self.manifest.get("splits", {}):
            return None
        return ShardSplit(
            self.path, split, cache_dir=cache_dir, storage_options=self.storage_options, manifest=self.manifest
        )


def open_sources(specs: list[dict[str, Any]], storage_options: dict | None) -> list[Source]:
    """Validate ``[{path, weight}]`` and read each manifest; refuses mixed vocabularies."""
    sources = []
    for i, spec in enumerate(specs):
        setting = "data.path" if len(specs) == 1 and "weight" not in spec else f"data.sources[{i}]"
        if not isinstance(spec, dict) or not spec.get("path"):
            raise ConfigError(f"{setting} needs a path (a prepared directory or s3://BUCKET/PREFIX): got {spec!r}")
        weight = spec.get("weight", 1.0)
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            raise ConfigError(f"{setting}.weight={spec.get('weight')!r} must be a positive number")
        path = str(spec["path"]) if is_remote(str(spec["path"])) else str(Path(str(spec["path"])).expanduser())
        options = spec.get("storage_options", storage_options)
        manifest = load_manifest(path, options, setting=f"{setting}.path" if setting != "data.path" else setting)
        train = manifest.get("splits", {}).get("train", {})
        if int(train.get("tokens", 0)) == 0:
            raise ConfigError(f"{setting}={path} holds no training tokens; prepare it from non-empty documents")
        sources.append(Source(path, weight, setting, manifest, options))
    fingerprints = {s.manifest["tokenizer"]["fingerprint"] for s in sources}
    if len(fingerprints) > 1:
        detail = ", ".join(
            f"{s.setting}: vocab {s.manifest['tokenizer']['vocab_size']} ({s.manifest['tokenizer']['fingerprint']})"
            for s in sources
        )
        raise ConfigError(
            f"the sources were prepared with different tokenizers ({detail}); prepare every source "
            "with the same data.tokenizer"
        )
    return sources


def shards_tokenizer(source: Source, cache_dir: Path) -> HFTokenizer:
    """The tokenizer stored with ``source``'s shards (downloaded into the cache when remote)."""
    if not is_remote(source.path):
        return HFTokenizer(Path(source.path) / "tokenizer.json")
    fp = source.manifest["tokenizer"]["fingerprint"]
    local = cache_dir / "tokenizers" / f"{fp}.json"
    if not local.is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(read_text(tokenizer_path(source.path), source.storage_options))
        os.replace(tmp, local)
    return HFTokenizer(local)


def check_tokenizer(source: Source, tokenizer: Tokenizer) -> None:
    """Refuse shards made by another tokenizer than the run's ``data.tokenizer``."""
    want = source.manifest["tokenizer"]
    got = tokenizer_fingerprint(tokenizer)
    if got != want["fingerprint"]:
        raise ConfigError(
            f"{source.setting}={source.path} was prepared with another tokenizer (vocab {want['vocab_size']}, "
            f"fingerprint {want['fingerprint']}) than data.tokenizer (vocab {tokenizer.vocab_size}, fingerprint "
            f"{got}); drop data.tokenizer.kind/path to use the shards' own, or re-run `lit-titan prepare` with it"
        )


def data_fingerprint(sources: list[Source], seq_len: int) -> str:
    """Identity of what the global order is built from: refuses a resume on changed data or seq_len."""
    payload = json.dumps(
        [
            [
                s.manifest.get("inputs"),
                s.manifest.get("splits", {}).get("train"),
                s.manifest["tokenizer"]["fingerprint"],
            ]
            for s in sources
        ]
        + [seq_len]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
