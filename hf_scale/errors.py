"""Errors hf_scale raises for bad input.

Each message names the offending value, the constraint it broke and what to do instead, so a
user reading one line of a torchrun log knows how to fix the launch.
"""


class HfScaleError(Exception):
    """Base class of every error hf_scale raises on purpose."""


class HfScaleConfigError(HfScaleError, ValueError):
    """A configuration value (or the launch environment) is invalid."""


class HfScalePlanError(HfScaleError, ValueError):
    """A model plan does not fit the model it is applied to."""


class HfScaleCheckpointError(HfScaleError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model."""


class HfScaleHubError(HfScaleError, RuntimeError):
    """The Hub refused or failed a request (authentication, permissions, network, server)."""
