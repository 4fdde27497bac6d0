"""docs/configuration.md is checked against conf/, so it cannot go stale; README lists every notebook."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from lit_titan.config import compose, conf_dir
from paths import ROOT

DOC = ROOT / "docs" / "configuration.md"
GROUPS = sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
# A reference-table row: | `key or option` | default | meaning |
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|([^|]*)\|")


def _flatten(node, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        elif not str(key).startswith("_") or name == "module._target_":  # _target_: the class, not a setting
            out[name] = value  # (but module._target_ is one: which class trains)
    return out


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _option_override(group: str, option: str) -> str:
    if group == "callbacks":
        return f"callbacks=[{option}]"
    if group == "recipe":
        return f"+recipe={option}"
    return f"{group}={option}"


@pytest.fixture(scope="module")
def config_keys() -> dict:
    """Every key of the default config, then of each option of every group, with its default.

    A key's default is its value in the default config, or else in the first option that has it.
    """
    keys = _flatten(OmegaConf.to_container(compose([]), resolve=False))
    for group in GROUPS:
        for option in _options(group):
            cfg = compose([_option_override(group, option)])
            for key, value in _flatten(OmegaConf.to_container(cfg, resolve=False)).items():
                keys.setdefault(key, value)
    return keys


@pytest.fixture(scope="module")
def doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def test_every_config_key_is_documented_with_its_default(config_keys, doc_rows):
    missing = sorted(k for k in config_keys if k not in doc_rows)
    assert not missing, f"docs/configuration.md lacks rows for {missing}"
    wrong = {
        k: (doc_rows[k], _fmt(v))
        for k, v in config_keys.items()
        if doc_rows[k].startswith("`") and doc_rows[k] != f"`{_fmt(v)}`"
    }
    assert not wrong, f"defaults in docs/configuration.md differ from conf/ (doc, conf): {wrong}"


def test_every_group_option_is_documented(doc_rows):
    missing = [_option_override(g, o) for g in GROUPS for o in _options(g) if _option_override(g, o) not in doc_rows]
    assert not missing, f"docs/configuration.md lacks rows for {missing}"


def test_every_documented_key_and_option_exists(config_keys, doc_rows):
    options = {_option_override(g, o) for g in GROUPS for o in _options(g)}
    stale = [name for name in doc_rows if name not in config_keys and name not in options]
    assert not stale, f"docs/configuration.md documents settings conf/ does not have: {stale}"


def test_readme_links_every_notebook_and_the_reference():
    readme = (ROOT / "README.md").read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{nb.name}" in readme, f"README.md does not mention notebooks/{nb.name}"
    assert "docs/configuration.md" in readme
