"""What :func:`hf_scale.parallelize` did to a model, kept on the model and read back by the
engine helpers (optimizer, checkpoints) that need the mesh or the strategy.

Usage::

    state = hf_scale.get_state(model)       # None for a model that was not parallelized
    state.config.strategy, state.dims.dp_degree if state.dims else 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from .config import ParallelConfig
    from .distributed import DistEnv
    from .mesh import ParallelDims
    from .model_plans import ModelPlan

STATE_ATTR = "_hf_scale_state"


@dataclass(frozen=True)
class ParallelState:
    """What :func:`parallelize` did to a model; read it with :func:`get_state`."""

    config: ParallelConfig
    plan: ModelPlan
    env: DistEnv
    dims: ParallelDims | None  # None in one process
    mesh: Any  # DeviceMesh, or None in one process
    pipeline: Any = None  # hf_scale.parallel.pp_schedule.Pipeline under pipeline parallel

    @property
    def dp_mesh(self):
        return None if self.mesh is None else self.dims.dp_mesh(self.mesh)

    @property
    def tp_mesh(self):
        """The 1-D tensor-parallel sub-mesh, or None without tensor parallel."""
        return self.mesh["tp"] if self.mesh is not None and self.dims.tp > 1 else None

    @property
    def pp_mesh(self):
        """The 1-D pipeline sub-mesh, or None without pipeline parallel."""
        return self.mesh["pp"] if self.mesh is not None and self.dims.pp > 1 else None

    @property
    def cp_mesh(self):
        """The 1-D context-parallel sub-mesh, or None without context parallel."""
        return self.mesh["cp"] if self.mesh is not None and self.dims.cp > 1 else None

    @property
    def cp_degree(self) -> int:
        """Ranks each sequence is split over (1 without context parallel); they share a batch."""
        return 1 if self.dims is None else self.dims.cp

    @property
    def pp_degree(self) -> int:
        return 1 if self.dims is None else self.dims.pp

    @property
    def pp_rank(self) -> int:
        return 0 if self.mesh is None else self.dims.pp_rank(self.mesh)

    @property
    def dp_degree(self) -> int:
        """How many ranks see different batches (1 in one process)."""
        return 1 if self.dims is None else self.dims.dp_degree

    @property
    def dp_rank(self) -> int:
        """Which of the ``dp_degree`` batches this rank sees: ranks of one tensor-parallel or
        context-parallel group share it. Use it, not RANK, to shard data."""
        return 0 if self.mesh is None else self.dims.dp_rank(self.mesh)

    @property
    def dp_group(self):
        """Process group over the data-parallel ranks (None when there is one), for reducing
        per-batch metrics such as token counts without counting a tp (or cp) group's tokens twice."""
        return None if self.mesh is None else self.dims.dp_group(self.mesh)


def get_state(model: nn.Module) -> ParallelState | None:
    """The :class:`ParallelState` of a parallelized model, or None."""
    return getattr(model, STATE_ATTR, None)
