"""The one place where lit-titan silences messages of its dependencies that a user cannot act on.

Why: a new user reads every line of the first run; a warning they cannot act on teaches them to
ignore warnings. Each entry names the emitting module and an exact message regex, why it is
harmless in lit-titan's use, and the version it was seen with, so it can be dropped when the
dependency changes. Never a blanket filter: any other warning still shows, and the test
``tests/commands/test_first_hour.py::test_default_run_prints_no_warning`` fails on a new one.

Our own causes are fixed where they arise, not here (the run directory vs the CSV logger:
``lit_titan/observe/csv_logger.py``; the flight recorder's deprecated variable: ``observe/flight_recorder.py``).

Installed on ``import lit_titan`` (every entry point, every rank, the notebooks).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

__all__ = ["KNOWN_WARNINGS", "KNOWN_LOG_LINES", "add_warning_filters", "install"]


@dataclass(frozen=True)
class Known:
    module: str  # regex on the module the message is attributed to (warnings) / the logger name (logging)
    message: str  # regex matched from the start of the message
    reason: str
    seen_with: str


KNOWN_WARNINGS = (
    Known(
        module=r"lightning\.pytorch\.utilities\._pytree",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        reason="Lightning's own pytree helper builds torch's LeafSpec, which torch deprecated; it works and "
        "only Lightning can change it",
        seen_with="lightning 2.6.6, torch 2.15",
    ),
    # Hydra attributes it 11 frames up (stacklevel=11): to whichever caller composed the config.
    Known(
        module=r".*",
        message=r"\s*'hydra/launcher/submitit_(local|slurm)' is validated against ConfigStore",
        reason="conf/hydra/launcher/submitit_*.yaml shadow the plugin's configs of the same name (filled from "
        "the cluster profile); each holds every key the launcher reads, so it works the same when "
        "Hydra stops merging them with the plugin's schema",
        seen_with="hydra-core 1.3.8, hydra-submitit-launcher 1.2.0",
    ),
    Known(
        module=r"lightning\.pytorch\.loops\.training_epoch_loop",
        message=r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is "
        r"not resumable",
        reason="lit-titan resumes the data by counter: the datamodule's state_dict holds the data position and "
        "the sampler starts there (data/datamodule.py, batches.StepSampler), so the next batch is exactly "
        "the one an uninterrupted run reads (test_checkpoint.py::test_resume_is_bitwise_exact); Lightning "
        "only looks for a state_dict on the DataLoader itself",
        seen_with="lightning 2.6.6",
    ),
    Known(
        module=r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state",
        message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
        reason="a pipeline stage's output is a view (F.linear over [batch, seq, dim] reshapes its matmul); "
        "nothing applies an in-place op to it (the schedule hands it to the loss or sends it to the "
        "next stage), which is what the warning is about; the pipeline parity tests compare the "
        "gradients with one process",
        seen_with="torch 2.15",
    ),
    Known(
        module=r"torch\.distributed\.device_mesh",
        message=r"Slicing a flattened dim from root mesh will be deprecated",
        reason="HSDP's 2-D mesh (dp_replicate x dp_shard_cp) is sliced from the root mesh after dp_shard_cp was "
        "flattened (strategies/strategy.py), as TorchTitan does; torch 2.11-2.15 still support it and have "
        "no replacement common to all of them (keeping the flattened meshes ourselves is the change it "
        "asks for); the HSDP parity cases compare gradients with one process",
        seen_with="torch 2.15",
    ),
    Known(
        module=r"tqdm\.auto",
        message=r"IProgress not found",
        reason="importing Lightning in a Jupyter kernel without ipywidgets; lit-titan's progress bar prints "
        "plain lines there (a kernel's stdout is not a terminal), so no widget is needed",
        seen_with="tqdm 4.70.1, lightning 2.6.6",
    ),
)

KNOWN_LOG_LINES = (
    Known(
        module=r"lightning\.(pytorch|fabric)\.utilities\.rank_zero",
        message=r"💡 Tip: For seamless cloud logging and experiment tracking, try installing \[litlogger\]",
        reason="an advertisement for a hosted product, printed on every fit without a LitLogger",
        seen_with="lightning 2.6.6",
    ),
    Known(
        module=r"torch\.utils\._pytree",
        message=r"<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch\.compile",
        reason="torchao registers its own enum as a pytree constant on import (Float8: every `lit-titan plan` "
        "of a recipe with float8, every run with callbacks=[float8]); torch still accepts it, and only "
        "torchao can drop the call",
        seen_with="torchao 0.18.0, torch 2.15",
    ),
    Known(
        module=r"torch\.distributed\.tensor\._redistribute",
        message=r"While redistributing from \(_NormPartial",
        reason="the gradient norm for clipping (strategies/grad_norm.py) under FSDP x TP is a scalar partial "
        "over two mesh dimensions, reduced by two all-reduces of one number instead of one: every rank "
        "receives the same result (the losses match one device: tests/parity/test_parallel.py); printed once "
        "per rank, nothing a user can change (flattening the mesh for it is the strategy's job)",
        seen_with="torch 2.15",
    ),
    Known(
        module=r"torch\._inductor\.codecache",
        message=r"fx graph cache unable to serialize compiled graph",
        reason="inductor could not pickle a compiled graph for its on-disk cache (seen: a graph of a dp x tp "
        "block under callbacks=[compile] holding a process group, on some ranks of a cold cache only); the "
        "graph runs the same, only a later process compiles it again instead of loading it, which no "
        "setting of ours changes (test_callbacks.py's compile x TP x FSDP test compares the losses)",
        seen_with="torch 2.15",
    ),
)

# The loggers the known log lines come from (a logging filter acts on the records of its own logger).
# rank_zero_info logs through the logger of the rank_zero module that imported last (fabric's, then
# pytorch's), so both carry the filter.
_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "torch.utils._pytree",
    "torch.distributed.tensor._redistribute",
    "torch._inductor.codecache",
)


def add_warning_filters() -> None:
    """One ``ignore`` filter per known warning, in front of the current filters.

    ``install`` calls it once; pytest resets the filters around every test, so the test suite calls it
    again inside each test (tests/conftest.py), which makes this list the one place that silences a
    dependency there too."""
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, module=known.module)


class _DropKnown(logging.Filter):
    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


_installed = False


def install() -> None:
    """Add one ``warnings`` filter per known warning and a logging filter for the known log lines (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    add_warning_filters()
    for name in _LOGGERS:
        pattern = [re.compile(k.message) for k in KNOWN_LOG_LINES if re.fullmatch(k.module, name)]
        logging.getLogger(name).addFilter(_DropKnown(pattern))
