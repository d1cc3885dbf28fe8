"""The old import paths of modules renamed in 0.2 (issue 26: one name, one meaning), kept
working for one release: ``import hf_scale.planner.cost`` gives ``hf_scale.layout_search.cost``
itself (the same module object, so patches and ``isinstance`` agree), with a
``DeprecationWarning`` naming the new path. Installed by ``import hf_scale``.

Usage::

    from hf_scale.plans import register_plan     # works, warns: now hf_scale.model_plans
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module path -> new; a path inside an old package moves with it (hf_scale.planner.cost)
MOVED = {
    "hf_scale.planner.report": "hf_scale.layout_search.ranking",
    "hf_scale.layout_search.report": "hf_scale.layout_search.ranking",  # from hf_scale.planner import report
    "hf_scale.planner": "hf_scale.layout_search",
    "hf_scale.plans": "hf_scale.model_plans",
    "hf_scale.plan_report": "hf_scale.layout_preview",
    "hf_scale.checkpoint.state": "hf_scale.checkpoint.training_state",
    "hf_scale.checkpoint.layout": "hf_scale.checkpoint.shard_layout",
    "hf_scale.state": "hf_scale.parallel_state",
    "hf_scale.train.report": "hf_scale.train.finish",
    "hf_scale.cli_args": "hf_scale.strict_args",
    "hf_scale.hub.cli": "hf_scale.hub.push_command",
    "hf_scale.train.host_memory": "hf_scale.host_memory",  # the loader trims the heap too (0.2)
}


def new_name(name: str) -> str | None:
    """Where module ``name`` lives now, or None when it was not moved."""
    if name in MOVED:
        return MOVED[name]
    for old, new in MOVED.items():
        if name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        new = new_name(module.__name__)
        warnings.warn(f"{module.__name__} is now {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)  # the import returns this one


def install() -> None:
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
