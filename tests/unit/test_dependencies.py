"""pyproject.toml declares every distribution whose modules hf_scale imports (httpx2 was not)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_modules() -> dict[str, str]:
    """Top-level module -> a file of hf_scale that imports it (absolute imports only)."""
    found = {}
    for path in sorted((ROOT / "hf_scale").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def test_every_imported_distribution_is_declared():
    dists = importlib.metadata.packages_distributions()
    deps, missing = declared(), []
    for module, where in imported_top_modules().items():
        if module in sys.stdlib_module_names or module in ("hf_scale", "__future__"):
            continue
        owners = {canonical(d) for d in dists.get(module, [])}
        assert owners, f"{where} imports {module}, which no installed distribution provides"
        if not owners & deps:
            missing.append(f"{module} ({where}; from {', '.join(sorted(owners))})")
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)
