"""Compose the job config from ``conf/`` with Hydra, Hydra's errors as one line.

Composing checks nothing unless asked (``check=True``: the schema): ``lit_titan.config.spec.validate``
checks a config once for every command (schema, then the cross-key rules, then the ``JobSpec``)."""

from __future__ import annotations

import importlib.resources
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_titan.config.schema_check import check_schema, compose_error_line
from lit_titan.errors import ConfigError

RUN_DIR_ENV = "LIT_TITAN_RUN_DIR"


def conf_dir() -> Path:
    """``conf/`` of the repository, or of the installed wheel (package ``lit_titan.conf``)."""
    return Path(str(importlib.resources.files("lit_titan.conf")))


def default_run_dir(run_dir: str | None, model_name: str) -> str:
    """``run_dir``, else the one the launching process chose (LIT_TITAN_RUN_DIR), else runs/<model>-<stamp>.

    The stamp is torchrun's run id when there is one, so every rank of a torchrun job agrees on it;
    children Lightning starts inherit LIT_TITAN_RUN_DIR from the parent.
    """
    if run_dir:
        return str(run_dir)
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    stamp = os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return str(Path("runs") / f"{model_name}-{stamp}")


def _register_resolvers() -> None:
    """Resolvers conf/train.yaml's ``hydra:`` node uses: Hydra's run/sweep directory *is* ``run_dir``."""
    OmegaConf.register_new_resolver("lit_titan.run_dir", default_run_dir, replace=True, use_cache=True)
    # use_cache: Hydra copies the cache to every sweep point, so all points agree on the stamp.
    OmegaConf.register_new_resolver(
        "lit_titan.sweep_dir",
        lambda run_dir: str(run_dir) if run_dir else str(Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"),
        replace=True,
        use_cache=True,
    )


_register_resolvers()


def compose(
    overrides: list[str] | tuple[str, ...] = (), config_name: str = "train", *, check: bool = False
) -> DictConfig:
    """``conf/<config_name>.yaml`` with ``overrides``; ``check``: its schema too (types, keys, ranges).

    Unchecked by default because ``spec.validate`` checks it: a command that validates does not also
    pass ``check``, one that only needs well-typed keys (prepare, export, the planner) does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        detail = " ".join((str(err).strip() or str(err.__cause__ or "").strip() or type(err).__name__).split())
        line = compose_error_line(
            f"{detail} {err.__cause__ or ''}",
            list(overrides),
            lambda group: sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")),
        )
        error = ConfigError(line or f"{detail}; config groups and their options: {conf_dir()}")
        error.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise error from err
    if check:
        try:
            check_schema(cfg)
        except ConfigError as err:
            err.raised_on_every_rank = True  # type: ignore[attr-defined]
            raise
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
