"""Will the shrunk job fit? Refused in one line before any process starts, with the fix.

The reference holds the whole shrunk model in one process: its weights, gradients and two optimizer moments,
plus the whole weights and gradients the dump gathers; all in float64 here. Activations of a few short
sequences are small next to that. Only the host's memory is checked (a GPU's is the job's own concern).
"""

from __future__ import annotations

from lit_titan.config import ConfigError
from lit_titan.config.spec import JobSpec

__all__ = ["check_memory", "needed_bytes"]

COPIES = 6  # weights, gradients, two moments, the dump's gathered weights and gradients
BYTES = {"64-true": 8, "32-true": 4}


def needed_bytes(spec: JobSpec) -> int:
    from lit_titan.planner.analytic import module_numel

    numel = sum(a + b for a, b in module_numel(spec.model).values())
    return numel * BYTES.get(spec.precision, 4) * COPIES


def check_memory(spec: JobSpec, accelerator: str) -> None:
    if accelerator != "cpu":
        return
    available = _available_bytes()
    need = needed_bytes(spec)
    if available and need > available:
        raise ConfigError(
            f"verify: the shrunk model needs about {need / 2**30:.1f} GiB in one process in {spec.precision}, "
            f"this machine has {available / 2**30:.1f} GiB free; narrow it for the check (model.dim=, "
            "model.vocab_size=, model.n_heads= kept divisible by the layout) or run it on GPUs"
        )


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
