"""Parallel degrees, their validation, and the 5-D DeviceMesh built from them.

Dims, outer to inner: pp, dp_replicate, dp_shard, cp, tp (tp innermost: it talks most, so it gets
the fastest links). Flattened views: ``dp`` (data loading), ``dp_shard_cp`` (FSDP sharding),
``dp_cp`` (loss and metric reduction).

Expert parallel (``ep``, TorchTitan's layout) borrows its ranks from dp_shard x cp: those ranks,
flattened, are split into ``efsdp x ep`` (ep inner), a second mesh over the same ranks with dims
pp, dp_replicate, efsdp, ep, tp. Routed experts are sharded over ``ep`` (over ``ep x tp`` when tp > 1:
every tp rank computes a share of the routed tokens, so each holds its own experts) and FSDP-sharded over
``efsdp`` (x dp_replicate under HSDP); everything else is laid out as without EP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lit_titan.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")


class LayoutError(UserError):
    """A parallel layout that cannot work; the message names the setting to change."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    world_size: int = 1
    ep: int = 1

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """Fill ``dp_shard=-1`` with the ranks left over and check the degrees multiply to the world."""
        for name, value in (("pp", pp), ("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp), ("ep", ep)):
            if value < 1:
                raise LayoutError(f"parallel.{name}={value} must be >= 1")
        if dp_shard == 0 or dp_shard < -1:
            raise LayoutError(f"parallel.dp_shard={dp_shard} must be >= 1, or -1 for 'the remaining ranks'")
        others = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % others:
                raise LayoutError(
                    f"parallel.dp_shard=-1: pp*dp_replicate*cp*tp = {pp}*{dp_replicate}*{cp}*{tp} = {others} does "
                    f"not divide the world size {world_size} (cluster.devices x cluster.num_nodes); change the "
                    f"degrees or cluster.devices/num_nodes"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise LayoutError(
                f"parallel.dp_shard={dp_shard}: the degrees pp*dp_replicate*dp_shard*cp*tp = {pp}*{dp_replicate}*"
                f"{dp_shard}*{cp}*{tp} = {others * dp_shard} but the world size is {world_size}; set parallel.dp_shard=-1 or change "
                f"cluster.devices (processes per node) / cluster.num_nodes to match"
            )
        if (dp_shard * cp) % ep:
            raise LayoutError(
                f"parallel.ep={ep}: expert parallel borrows its ranks from dp_shard x cp = {dp_shard}*{cp} = "
                f"{dp_shard * cp}, which it does not divide; use parallel.ep in {_divisors(dp_shard * cp)}"
            )
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world_size, ep=ep)

    # ---- derived sizes --------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The ranks that hold the same experts within dp_shard x cp: FSDP shards the experts over them."""
        return self.fsdp_size // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(MESH_DIMS, self.shape))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each dim (row-major over MESH_DIMS), without any process group."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(MESH_DIMS, self.shape))):
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ---- validation against the model and data --------------------------------------------------
    def validate(
        self, *, n_heads: int | None = None, n_kv_heads: int | None = None, seq_len: int | None = None
    ) -> None:
        """The degrees against the model's heads and the sequence length (the batch split: ``BatchLayout``)."""
        if n_heads is not None and n_heads % self.tp:
            raise LayoutError(
                f"parallel.tp={self.tp}: does not divide the model's n_heads={n_heads}; use "
                f"parallel.tp in {_divisors(n_heads)}"
            )
        if n_kv_heads is not None and n_kv_heads % self.tp:
            raise LayoutError(
                f"parallel.tp={self.tp}: does not divide the model's n_kv_heads={n_kv_heads}; use "
                f"parallel.tp in {_divisors(n_kv_heads)}"
            )
        if seq_len is not None:
            # cp>1 splits each sequence into 2*cp chunks (causal load balance); tp>1 shards it by tp
            # between blocks (sequence parallel).
            unit = self.tp * (2 * self.cp if self.cp > 1 else 1)
            if seq_len % unit:
                raise LayoutError(
                    f"data.seq_len={seq_len}: not divisible by "
                    f"{'2*cp*tp' if self.cp > 1 else 'tp'}={unit}; use a multiple of {unit}, e.g. "
                    f"data.seq_len={max(unit, seq_len // unit * unit)}"
                )

    @property
    def expert_shards(self) -> int:
        """How many ways the routed experts are split: ``ep``, times ``tp`` when both are on (ep x tp)."""
        return self.ep * self.tp if self.ep > 1 else 1

    def validate_experts(self, num_experts: int | None) -> None:
        """``ep`` against the model's routed experts (None: a dense model, which ``ep > 1`` cannot split)."""
        if self.ep > 1 and not num_experts:
            raise LayoutError(
                f"parallel.ep={self.ep}: the model has no routed experts (a dense model); use parallel.ep=1 "
                f"or a Mixture-of-Experts model"
            )
        if num_experts and num_experts % self.expert_shards:
            if self.tp > 1:
                raise LayoutError(
                    f"parallel.ep={self.ep}: with parallel.tp={self.tp} the experts are split over ep x tp = "
                    f"{self.expert_shards} ranks, which does not divide the model's {num_experts} experts; use "
                    f"parallel.ep in {[d for d in _divisors(self.fsdp_size) if d == 1 or num_experts % (d * self.tp) == 0]}"
                )
            raise LayoutError(
                f"parallel.ep={self.ep}: does not divide the model's {num_experts} experts; use parallel.ep in "
                f"{[d for d in _divisors(num_experts) if self.fsdp_size % d == 0]}"
            )

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
        """The 5-D mesh and its flattened views {dp, dp_shard_cp, dp_cp}; needs the process group.

        The views are kept by the caller: slicing a flattened dim back out of the root mesh is
        deprecated from torch 2.11. With ``ep > 1`` also ``ep`` and ``efsdp`` (with HSDP
        ``dp_replicate_efsdp``), slices of the expert mesh: FSDP composes an expert's EP sharding with
        its own only over meshes of one root.
        """
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        # DeviceMesh has no public flatten yet (torch 2.11-2.14); _flatten is what TorchTitan uses.
        views = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        if self.ep > 1:
            # The same ranks in the same row-major order, dp_shard x cp re-split as efsdp x ep.
            shape = (self.pp, self.dp_replicate, self.efsdp, self.ep, self.tp)
            expert_mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_MESH_DIMS)
            views["ep"] = expert_mesh["ep"]
            if self.tp > 1:  # the routed experts' shards and their all-to-all group (ep outer, tp inner)
                views["ep_tp"] = expert_mesh["ep", "tp"]._flatten("ep_tp")
            views["efsdp"] = expert_mesh["efsdp"]
            if self.dp_replicate > 1:
                views["dp_replicate_efsdp"] = expert_mesh["dp_replicate", "efsdp"]
        return mesh, views


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
