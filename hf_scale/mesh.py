"""Parallel degrees -> a validated ``DeviceMesh``.

The mesh always has the five named dimensions ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``
(size 1 where unused), the layout torchtitan uses, so tensor, context and pipeline parallel slot
in without changing how the data-parallel part is addressed::

    dims = ParallelDims.resolve(ParallelConfig(strategy="hsdp", dp_replicate=2), world_size=8)
    mesh = build_mesh(dims, "cuda")        # 1 x 2 x 4 x 1 x 1
    dims.dp_mesh(mesh)                     # mesh["dp_replicate", "dp_shard"]

Context parallel (``cp``) ranks share a batch, as tensor-parallel ranks do: the data-parallel
rank, degree and group (what the loader and the metrics read) leave ``cp`` out, while the
gradients are reduced over ``dp x cp`` (:meth:`ParallelDims.dp_cp_mesh`: FSDP shards over the
flattened ``dp_shard_cp``, DDP averages over ``dp_cp``)::

    dims = ParallelDims.resolve(ParallelConfig(cp=2), world_size=4)   # dp_shard=2 x cp=2
    dims.dp_degree, dims.dp_cp_mesh(mesh)  # 2, mesh["dp_shard_cp"] (4 ranks)
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ParallelConfig
from .errors import HfScaleConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1  # ranks one sequence is split over; they share a batch (not counted in dp_degree)
    ep: int = 1  # carved out of dp_shard (or dp_replicate): not a dimension of its own in the product
    # ddp / zero1: the model replicated over dp_replicate, no FSDP; ep is then carved out of dp_replicate
    replicated: bool = False

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in MESH_DIMS}
        for name, size in {**sizes, "ep": self.ep}.items():
            if not isinstance(size, int) or size < 1:
                raise HfScaleConfigError(f"{name}={size!r} must be a positive integer ({self}).")
        if self.ep > 1 and self.replicated:
            # replicated data parallel (ddp): ep carved out of the replicas; the ranks holding the
            # same experts (dp_replicate / ep of them) FSDP-shard them
            if self.dp_replicate % self.ep:
                raise HfScaleConfigError(
                    f"ep={self.ep} does not divide the {self.dp_replicate} data-parallel ranks of "
                    f"strategy='ddp': the expert-parallel ranks are carved out of them. Choose an ep "
                    f"that divides {self.dp_replicate}, or start a multiple of {self.ep} processes."
                )
        elif self.dp_shard % self.ep:
            shown = self.describe_degrees()
            raise HfScaleConfigError(
                f"ep={self.ep} does not divide dp_shard={self.dp_shard} ({shown}): the expert-parallel "
                "ranks are carved out of the data-parallel shard ranks. Choose an ep that divides "
                f"{self.dp_shard}, or start a multiple of {self.ep * self.tp * self.pp} processes"
                + (f", or set a smaller dp_replicate (or strategy='ddp' with ep={self.dp_replicate}: each "
                   "replica its own experts)." if self.dp_replicate > 1 else ".")
            )
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            shown = self.describe_degrees()
            raise HfScaleConfigError(
                f"{shown} = {product} ranks, but WORLD_SIZE={self.world_size}. The degrees "
                "must multiply to the world size: change dp_replicate/dp_shard, or the "
                "number of processes torchrun starts."
            )

    @classmethod
    def resolve(
        cls, config: ParallelConfig, world_size: int, num_nodes: int = 1
    ) -> ParallelDims:
        """Fill the degrees ``config`` leaves open from the world size (and node count)."""
        tp, pp, cp = config.tp, config.pp, config.cp
        if world_size % (tp * pp * cp):
            named = [(n, v) for n, v in (("tp", tp), ("pp", pp), ("cp", cp)) if v > 1] or [("tp", tp)]
            both = (" x ".join(n for n, _ in named) + " = " + " x ".join(str(v) for _, v in named)
                    + f" = {tp * pp * cp}") if len(named) > 1 else f"{named[0][0]}={named[0][1]}"
            raise HfScaleConfigError(
                f"{both} does not divide WORLD_SIZE={world_size}: start a multiple of {tp * pp * cp} "
                f"processes, or choose degrees whose product divides {world_size}."
            )
        rest = world_size // (tp * pp * cp)
        strategy = config.strategy
        if pp > 1 and strategy in ("ddp", "zero1") and rest > 1:
            raise HfScaleConfigError(
                f"strategy={strategy!r} with pp={pp} over {rest} data-parallel ranks: the pipeline "
                "schedule drives FSDP's gradient reduction, not DDP's. Use strategy='zero2' (DDP's "
                "speed, gradients and optimizer state sharded) or 'fsdp' with pp."
            )
        if strategy in ("ddp", "zero1"):
            replicate, shard = config.dp_replicate or rest, 1
        else:
            replicate = config.dp_replicate
            if replicate is None and strategy == "hsdp" and config.dp_shard:
                _check_divides("dp_shard", config.dp_shard, rest)
                replicate = rest // config.dp_shard
            elif replicate is None:
                replicate = num_nodes if strategy == "hsdp" else 1
            _check_divides("dp_replicate", replicate, rest)
            shard = config.dp_shard or rest // replicate
            if strategy == "hsdp" and replicate < 2 and rest > 1:
                raise HfScaleConfigError(
                    f"strategy='hsdp' needs dp_replicate >= 2 (got dp_replicate={replicate}, "
                    f"world size {world_size}, {num_nodes} node(s)). Set dp_replicate, e.g. "
                    f"dp_replicate=2 dp_shard={max(1, world_size // 2)}, or use 'fsdp'."
                )
        if config.cpu_offload and tp > 1 and rest == 1:
            raise HfScaleConfigError(
                f"cpu_offload=True offloads FSDP's shards, but tp={tp} uses all {world_size} "
                "processes, so no data-parallel rank is left for FSDP. Start more processes "
                f"(e.g. {2 * world_size}, for fsdp over 2 x tp={tp}) or drop cpu_offload."
            )
        return cls(dp_replicate=replicate, dp_shard=shard, world_size=world_size, tp=tp, pp=pp, cp=cp, ep=config.ep,
                   replicated=strategy in ("ddp", "zero1"))

    @property
    def dp_degree(self) -> int:
        """How many data-parallel ranks see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp_degree(self) -> int:
        """How many ranks reduce gradients together: the data-parallel ones times the context-parallel
        ones (each cp rank holds the gradient of its part of the sequences)."""
        return self.dp_degree * self.cp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def pp_rank(self, mesh) -> int:
        """This rank's pipeline index (0 .. pp - 1)."""
        return dict(zip(MESH_DIMS, mesh.get_coordinate()))["pp"]

    def dp_rank(self, mesh) -> int:
        """This rank's data-parallel index (0 .. dp_degree - 1): ranks of one tensor-parallel
        or context-parallel group share it, and so see the same batch."""
        coords = dict(zip(MESH_DIMS, mesh.get_coordinate()))
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def dp_group(self, mesh):
        """Process group of the ranks that see different data (None when dp_degree is 1)."""
        if self.dp_degree == 1:
            return None
        both = self.dp_replicate > 1 and self.dp_shard > 1
        return mesh["dp"].get_group() if both else self.dp_mesh(mesh).get_group()

    @property
    def shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    def dp_mesh(self, mesh):
        """The data-parallel sub-mesh: 2-D ``(dp_replicate, dp_shard)`` for HSDP, else 1-D."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_replicate"] if self.dp_replicate > 1 else mesh["dp_shard"]

    def dp_cp_mesh(self, mesh):
        """The mesh gradients are reduced over: the data-parallel mesh, times ``cp`` under context
        parallel (FSDP: ``dp_shard_cp``, 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP; DDP:
        ``dp_cp``, flattened by :func:`build_mesh`)."""
        if self.cp == 1:
            return self.dp_mesh(mesh)
        if self.replicated:  # flattened again: the mesh build_mesh made (slicing it by name is deprecated)
            return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard_cp"]
        return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")

    def cp_mesh(self, mesh):
        """The 1-D context-parallel sub-mesh (the ranks that split one batch's sequences)."""
        return mesh["cp"]

    def describe_degrees(self) -> str:
        """``pp=1 x dp_replicate=1 x dp_shard=2 x tp=1`` (``cp`` shown where it is used)."""
        return " x ".join(f"{n}={getattr(self, n)}" for n in MESH_DIMS if n != "cp" or self.cp > 1)

    def describe(self) -> str:
        shown = self.describe_degrees()
        return shown + (f" (ep={self.ep} of {'dp_replicate' if self.replicated else 'dp_shard'})" if self.ep > 1 else "")

    def expert_meshes(self, mesh):
        """``(experts' weight mesh, experts' data-parallel mesh)``. Under expert parallel
        ``dp_shard`` is unflattened into ``efsdp x ep`` (ep innermost: the ranks of one ep group
        are neighbours); the weights live on ``ep`` (``ep x tp`` with tensor parallel) and are
        FSDP-sharded over ``efsdp`` (with ``dp_replicate`` under hsdp); under ddp ``dp_replicate``
        is unflattened the same way into ``erep x ep``, erep of one rank when ep is every replica. Same root mesh as
        ``mesh``, so FSDP composes the two (its TP/EP path). Without ep: ``tp`` and the dp mesh.
        Collective: call once, on every rank."""
        if self.ep == 1:
            return mesh["tp"], self.dp_mesh(mesh)
        if self.replicated:  # ddp: ep carved out of the replicas, the rest (erep) hold the same experts
            expert = mesh._unflatten("dp_replicate", (self.dp_replicate // self.ep, self.ep), ("erep", "ep"))
            return expert["ep"], expert["erep"]
        expert = mesh._unflatten("dp_shard", (self.dp_shard // self.ep, self.ep), ("efsdp", "ep"))
        expert["efsdp", "ep"]._flatten("efsdp_ep")  # one collective for a norm over both (DTensor finds it)
        dp = expert["dp_replicate", "efsdp"] if self.dp_replicate > 1 else expert["efsdp"]
        return (expert["ep", "tp"] if self.tp > 1 else expert["ep"]), dp


def _check_divides(name: str, size: int, dp_ranks: int) -> None:
    """``size`` must divide the ``dp_ranks`` data-parallel ranks (WORLD_SIZE / (tp x pp x cp))."""
    if dp_ranks % size:
        raise HfScaleConfigError(
            f"{name}={size} does not divide the {dp_ranks} data-parallel ranks (WORLD_SIZE / (tp x pp x cp)): "
            f"choose a {name} that divides {dp_ranks}, or start a multiple of {size} processes."
        )


def build_mesh(dims: ParallelDims, device_type: str):
    """Create the 5-D ``DeviceMesh`` over all ranks (the process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(getattr(dims, name) for name in MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    # Flattened views, so DTensor reduces over several dimensions in one collective (gradient
    # norms over dp_shard x tp) and metrics reduce over all data-parallel ranks at once.
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if dims.dp_shard > 1 and dims.tp > 1:
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    if dims.cp > 1:  # gradients reduce over dp x cp: FSDP shards over dp_shard x cp, DDP over all of them
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh
