"""Every ```yaml block of the pages under docs/ (and the README) is a recipe fragment that
``hf-scale finetune`` accepts: it loads as a recipe (its keys exist, its values pass the checks),
so an option renamed or refused leaves no example behind that would fail for a user."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_scale.train.config import load_job
from tests.unit.test_readme_commands import PAGES, fenced_blocks

BLOCKS = [(page.name, i, block) for page in PAGES for i, block in enumerate(fenced_blocks(page.read_text(), "yaml"))]


def test_the_pages_have_yaml_examples():
    assert {name for name, _, _ in BLOCKS} >= {"finetuning.md", "tracking.md"}


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_a_yaml_example_loads_as_a_recipe(tmp_path, page, index, block):
    recipe = Path(tmp_path) / "recipe.yaml"
    recipe.write_text(block)
    load_job(recipe)
