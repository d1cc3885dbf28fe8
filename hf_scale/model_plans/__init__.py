"""Model plans: the model knowledge hf_scale needs, kept apart from the engine."""

from . import (
    encoders,  # noqa: F401  (registers its entries)
    pp_registry,  # noqa: F401  (adds pp_plan where transformers declares none)
    tp_registry,  # noqa: F401  (after encoders: adds tp fields to their entries)
)
from .base import ModelPlan, register_plan, registered_fields, registered_model_types
from .from_hf import find_tied_parameters, fp32_modules, resolve_plan, wrap_units

__all__ = [
    "ModelPlan",
    "find_tied_parameters",
    "fp32_modules",
    "register_plan",
    "registered_fields",
    "registered_model_types",
    "resolve_plan",
    "wrap_units",
]
