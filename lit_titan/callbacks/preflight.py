"""Pre-flight diagnostics before training (``preflight.enabled``), as a Lightning callback's ``setup`` hook.

At ``setup`` the process group and the mesh exist (``TitanStrategy.setup_environment``) and the model
is not built yet, so a slow rank or link stops the job before a model, a checkpoint or a metrics
file exists. The measurements and the verdict are ``lit_titan.observe.diagnostics``.

``fault.slow_rank`` is the drill: that rank's burn-in is made ``fault.slow_factor`` times slower (by
sleeping), as a GPU with a thermal or clock problem would be; with
``fault.slow_link=intra_node|inter_node`` (or a mesh dim) its bandwidth over those groups is slowed
instead, as a bad NVLink or NIC would be.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

from lit_titan.callbacks.settings import FaultConfig, PreflightConfig
from lit_titan.observe.diagnostics import PreflightError, PreflightFinished, best_of, judge, measure, node_groups
from lit_titan.settings import settings_of
from lit_titan.strategies.contract import contract

__all__ = ["Preflight"]


class Preflight(L.Callback):
    """Runs the diagnostics in ``setup`` (process group up, nothing built) and acts on them.

    ``settings``: the ``preflight`` group (``PreflightConfig``) or its fields by name; ``drill``: the ``fault``
    group, whose ``slow_rank``/``slow_factor``/``slow_link`` make a rank slow on purpose; ``expected_tflops``:
    the cluster profile's peak, shown beside the measured median; ``confirm``: re-measurements before a
    verdict is kept.
    """

    def __init__(
        self,
        run_dir: str,
        settings: PreflightConfig | None = None,
        *,
        drill: FaultConfig | None = None,
        expected_tflops: float | None = None,
        confirm: int = 2,
        **keys: Any,
    ) -> None:
        s = self.settings = settings_of(PreflightConfig, settings, keys)
        drill = drill or FaultConfig()
        self.run_dir, self.action, self.threshold, self.only = Path(run_dir), s.action, s.threshold, s.only
        self.expected_tflops, self.slow_rank, self.slow_factor = expected_tflops, drill.slow_rank, drill.slow_factor
        self.slow_link, self.confirm = drill.slow_link, confirm
        self.result: dict[str, Any] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        mesh = contract(trainer.strategy).mesh
        if mesh is None or not dist.is_initialized():
            return  # one process without a mesh: nothing to compare
        t0 = time.perf_counter()
        slow = self.slow_factor if self.slow_rank == dist.get_rank() else 1.0
        node_of: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(node_of, int(trainer.node_rank))
        node_links = node_groups(node_of, trainer.strategy.root_device.type)

        def round_() -> list[Any]:
            mine = measure(
                mesh,
                trainer.strategy.root_device,
                slow_factor=slow,
                slow_link=self.slow_link,
                node=node_of[dist.get_rank()],
                node_links=node_links,
                node_of=node_of,
            )
            records: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(records, mine)
            return records

        records = round_()
        found, medians = judge(records, self.threshold)
        rounds = 1
        # every rank holds the same records, so every rank takes the same branch (same collectives)
        while found and rounds <= self.confirm:
            records = best_of(records, round_())
            found, medians = judge(records, self.threshold)
            rounds += 1
        self.result = {
            "ranks": records,
            "medians": medians,
            "threshold": self.threshold,
            "found": found,
            "expected_tflops": self.expected_tflops,
            "action": self.action,
            "rounds": rounds,
            "nodes": len(set(node_of)),
            "seconds": time.perf_counter() - t0,
        }
        line = (
            f"preflight: {'; '.join(found)}"
            if found
            else f"preflight: {len(records)} ranks ok (matmul median {medians['tflops']:.4g} TFLOP/s"
            + (f", profile peak {self.expected_tflops:.4g}" if self.expected_tflops else "")
            + ")"
        )
        if trainer.global_rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "preflight.json").write_text(json.dumps(self.result, indent=1))
        if found and self.action == "stop":
            raise PreflightError(
                f"{line}; preflight.action=stop: nothing trained (details: {self.run_dir / 'preflight.json'})"
            )
        if trainer.global_rank == 0:
            print(line, flush=True)
        if self.only:
            raise PreflightFinished(line)
