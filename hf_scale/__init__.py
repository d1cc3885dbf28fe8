"""hf_scale: distributed training of pretrained Hugging Face models in one call.

Inside a ``torchrun`` script::

    import hf_scale
    model = hf_scale.parallelize(model, hf_scale.ParallelConfig(strategy="fsdp"))
    optimizer = hf_scale.build_optimizer(model, lr=2e-5, weight_decay=0.1)

``import hf_scale`` is cheap: it loads the configuration and the errors only. Each public name
below imports its module on first use (PEP 562), so ``hf_scale.parallelize`` loads torch and the
engine, ``hf_scale.push_to_hub`` the Hub client, and nothing here loads the fine-tuning
application (``hf_scale.train``, the CLI), which sits on top of the library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _moved
from .config import ParallelConfig
from .errors import (
    HfScaleCheckpointError,
    HfScaleConfigError,
    HfScaleError,
    HfScaleHubError,
    HfScalePlanError,
)

_moved.install()  # the old paths of renamed modules, for one release

# public name -> the submodule that defines it, imported on first access
_LAZY = {
    "parallelize": ".api",
    "ParallelState": ".parallel_state",
    "get_state": ".parallel_state",
    "build_optimizer": ".parallel.optim",
    "clip_grad_norm_": ".parallel.optim",
    "no_sync": ".parallel.optim",
    "train_step": ".parallel.step",
    "eval_step": ".parallel.step",
    "from_pretrained": ".checkpoint",
    "save_pretrained": ".checkpoint",
    "load_state": ".checkpoint",
    "save_state": ".checkpoint",
    "load_adapter": ".checkpoint",
    "merge_adapter": ".checkpoint",
    "ModelPlan": ".model_plans",
    "register_plan": ".model_plans",
    "resolve_plan": ".model_plans",
    "CardInfo": ".hub",
    "push_to_hub": ".hub",
    "write_model_card": ".hub",
    "shutdown_distributed": ".distributed",
}

__all__ = [
    "CardInfo",
    "HfScaleCheckpointError",
    "HfScaleConfigError",
    "HfScaleError",
    "HfScaleHubError",
    "HfScalePlanError",
    "ModelPlan",
    "ParallelConfig",
    "ParallelState",
    "__version__",
    "build_optimizer",
    "clip_grad_norm_",
    "eval_step",
    "from_pretrained",
    "get_state",
    "load_adapter",
    "load_state",
    "merge_adapter",
    "no_sync",
    "parallelize",
    "push_to_hub",
    "register_plan",
    "resolve_plan",
    "save_pretrained",
    "save_state",
    "shutdown_distributed",
    "train_step",
    "write_model_card",
]


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("hf-scale")  # one source: pyproject.toml's [project] version
        except PackageNotFoundError:  # a source tree on sys.path that was never installed
            value = "0+unknown"
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module 'hf_scale' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names above load lazily
    from .api import parallelize
    from .checkpoint import (
        from_pretrained,
        load_adapter,
        load_state,
        merge_adapter,
        save_pretrained,
        save_state,
    )
    from .hub import CardInfo, push_to_hub, write_model_card
    from .model_plans import ModelPlan, register_plan, resolve_plan
    from .parallel.optim import build_optimizer, clip_grad_norm_, no_sync
    from .parallel.step import eval_step, train_step
    from .parallel_state import ParallelState, get_state
