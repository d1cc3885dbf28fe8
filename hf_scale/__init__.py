"""hf_scale: distributed training of pretrained Hugging Face models in one call.

Inside a ``torchrun`` script::

    import hf_scale
    model = hf_scale.parallelize(model, hf_scale.ParallelConfig(strategy="fsdp"))
    optimizer = hf_scale.build_optimizer(model, lr=2e-5, weight_decay=0.1)
"""

from .api import ParallelState, get_state, parallelize
from .checkpoint import from_pretrained, load_state, save_pretrained, save_state
from .config import ParallelConfig
from .errors import HfScaleCheckpointError, HfScaleConfigError, HfScaleError, HfScalePlanError
from .hub import CardInfo, push_to_hub, write_model_card
from .plans import ModelPlan, register_plan, resolve_plan
from .train import build_optimizer, clip_grad_norm_, no_sync

__version__ = "0.1.0"

__all__ = [
    "CardInfo",
    "HfScaleCheckpointError",
    "HfScaleConfigError",
    "HfScaleError",
    "HfScalePlanError",
    "ModelPlan",
    "ParallelConfig",
    "ParallelState",
    "build_optimizer",
    "clip_grad_norm_",
    "from_pretrained",
    "get_state",
    "load_state",
    "no_sync",
    "parallelize",
    "push_to_hub",
    "register_plan",
    "resolve_plan",
    "save_pretrained",
    "save_state",
    "write_model_card",
]
