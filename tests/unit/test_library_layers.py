"""The library apart from the application (issue 10, item 2).

``import hf_scale`` must stay cheap (the configuration and the errors, no torch), the engine must
load without the fine-tuning application, the Hub client or ``datasets``, and no library module
may import an application module. Each check runs in a fresh interpreter so modules loaded by
other tests do not hide an import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_scale"
# The application layer: it sits on top of the library and the library never imports it.
APP = ("hf_scale.train", "hf_scale.cli", "hf_scale.generate", "hf_scale.launch", "hf_scale.torchrun", "hf_scale.layout_preview", "hf_scale.zoo",
       "hf_scale.layout_search")
# The one way in from the library to the application: parallelize(model, "auto") asks the planner.
ENTRY_POINTS = {("hf_scale.api", "hf_scale.layout_search.auto")}
HEAVY = ("torch", "transformers", "datasets", "huggingface_hub", "accelerate", "hf_scale.hub",
         "transformers.trainer", *APP)


def loaded_after(code: str) -> list[str]:
    """The modules of HEAVY that ``code`` leaves in sys.modules, in a fresh interpreter."""
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_hf_scale_loads_no_torch_and_no_application():
    assert loaded_after("import hf_scale; hf_scale.ParallelConfig(strategy='fsdp'); hf_scale.HfScaleHubError") == []


def test_engine_names_load_without_application_hub_or_datasets():
    code = ("import hf_scale\nfor n in ('parallelize', 'build_optimizer', 'clip_grad_norm_', 'no_sync', "
            "'from_pretrained', 'save_pretrained', 'save_state', 'load_state', 'get_state'):\n"
            "    getattr(hf_scale, n)")
    loaded = loaded_after(code)
    assert "torch" in loaded  # the engine itself did load
    assert not set(loaded) & {"datasets", "hf_scale.hub", "transformers.trainer", *APP}, loaded


def test_hub_names_load_on_first_use():
    assert "hf_scale.hub" in loaded_after("import hf_scale; hf_scale.push_to_hub")


def test_every_public_name_resolves_and_version_has_one_source():
    import importlib.metadata

    import hf_scale

    for name in hf_scale.__all__:
        assert getattr(hf_scale, name) is not None, name
    assert hf_scale.__version__ == importlib.metadata.version("hf-scale")
    assert "__version__ =" not in (PACKAGE / "__init__.py").read_text()
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_scale.nope  # noqa: B018


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _is_app(module: str) -> bool:
    return any(module == app or module.startswith(app + ".") for app in APP)


def test_library_modules_never_import_the_application():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if _is_app(_module_name(path)):
            continue
        name = _module_name(path)
        bad = sorted(m for m in _imports(path) if _is_app(m) and not any(
            name == lib and (m == entry or m.startswith(entry + ".")) for lib, entry in ENTRY_POINTS))
        if bad:
            offenders[name] = bad
    assert offenders == {}


def test_no_module_imports_the_command_line():
    """``hf_scale.cli`` is the entry point: the commands it starts (``generate``) and the planner
    take their helpers from where those live (``read_model_config``: :mod:`hf_scale.train.model`),
    not from the CLI, which imports them."""
    importers = {_module_name(path) for path in PACKAGE.rglob("*.py")
                 if any(m == "hf_scale.cli" or m.startswith("hf_scale.cli.") for m in _imports(path))}
    assert importers - {"hf_scale.cli"} == set()


def test_zoo_names_are_compared_only_in_zoo():
    """Zoo knowledge lives in hf_scale/zoo.py: no other module branches on a ``zoo:`` name."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "zoo.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Constant) and str(side.value).startswith("zoo:"):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_zoo_models_serve_only_their_recipe_tasks():
    from hf_scale.errors import HfScaleConfigError
    from hf_scale.train.config import TASKS
    from hf_scale.zoo import ZOO, check_zoo_task

    assert {task for entry in ZOO.values() for task in entry.tasks} == set(TASKS)
    check_zoo_task("zoo:minilm", "sequence_classification")
    check_zoo_task("zoo:smollm2", "causal_lm")
    check_zoo_task("zoo:smollm2", "reward")  # a reward model: SmolLM2 with a one-score head
    with pytest.raises(HfScaleConfigError, match="zoo:smollm2 serves causal_lm / reward, not task 'sequence_classification'; "
                       "for sequence_classification use zoo:minilm"):
        check_zoo_task("zoo:smollm2", "sequence_classification")


def _import_graph() -> dict[str, set[str]]:
    """hf_scale module -> the hf_scale modules it imports (at any depth, lazy imports included):
    ``from package import name`` imports ``package.name`` when that is a module, else ``package``."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def module_of(dotted: str) -> str:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(module_of(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                edges.update(module_of(f"{module}.{alias.name}") for alias in node.names)
        graph[name] = edges - {"", name, "hf_scale"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    """No two hf_scale modules import each other, directly or around a loop, lazily or not
    (issue 26: api <-> planner.auto, cli <-> generate). The package root, whose names load lazily,
    is left out."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_renamed_modules_keep_their_old_paths_for_one_release():
    """Issue 26's renames: the old import paths give the new modules themselves, with a warning."""
    code = (
        "import warnings, json, sys\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from hf_scale.planner import report as old_ranking  # first: no attribute to find yet\n"
        "    from hf_scale.plans import register_plan\n"
        "    import hf_scale.planner.cost as old_cost\n"
        "    from hf_scale.planner.report import plan_text\n"
        "    from hf_scale.state import get_state\n"

        "import hf_scale.layout_search.cost as cost, hf_scale.model_plans as plans\n"
        "import hf_scale.layout_search.ranking as ranking, hf_scale.parallel_state as state\n"
        "print(json.dumps([old_cost is cost, register_plan is plans.register_plan, plan_text is ranking.plan_text,\n"
        "                  get_state is state.get_state, sys.modules['hf_scale.plans'] is plans, old_ranking is ranking,\n"
        "                  sorted({str(w.message).split(';')[0] for w in caught})]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    *same, warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert same == [True] * 6
    assert warned == ["hf_scale.layout_search.report is now hf_scale.layout_search.ranking",
                      "hf_scale.planner is now hf_scale.layout_search",
                      "hf_scale.planner.cost is now hf_scale.layout_search.cost",
                      "hf_scale.planner.report is now hf_scale.layout_search.ranking",
                      "hf_scale.plans is now hf_scale.model_plans", "hf_scale.state is now hf_scale.parallel_state"]
    from hf_scale._moved import MOVED

    for new in MOVED.values():
        assert (PACKAGE.parent / new.replace(".", "/")).with_suffix(".py").exists() or \
            (PACKAGE.parent / new.replace(".", "/") / "__init__.py").exists(), new


def test_public_names_load_through_the_new_paths():
    """``hf_scale.get_state``, ``hf_scale.ModelPlan``... never go through an old path's warning."""
    code = ("import warnings\nwarnings.filterwarnings('error', message='.* is now hf_scale', category=DeprecationWarning)\n"
            "import hf_scale\nfor name in hf_scale.__all__:\n    getattr(hf_scale, name)\n"
            "from hf_scale.planner import report  # an old path through from-import (warns, as it may)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 1 and "hf_scale.planner is now hf_scale.layout_search" in out.stderr, out.stderr[-2000:]
    assert "__all__" not in out.stderr and "getattr(hf_scale, name)" not in out.stderr, out.stderr[-2000:]
