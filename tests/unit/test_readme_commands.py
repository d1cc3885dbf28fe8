"""The README is a front door that works: its commands run, and every relative link of the README
and of the pages under docs/ points to a file (and a heading) that exists.

Every line of README.md's ```bash blocks is either run here (``RUN``: seconds each, exit 0
checked) or listed in ``NOT_RUN`` with the reason (minutes of training, the Hub, the output of an
earlier step). A command in neither fails :func:`test_every_readme_command_is_run_or_not_run_with_a_reason`,
so a command added to the README cannot go unchecked; an entry no longer in the README fails it
too. The commands run with the worktree's code (``PYTHONPATH``) and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

# command -> a piece of what it prints (checked besides exit 0)
RUN = {
    "hf-scale --help": "hf-scale finetune",
    "hf-scale plan configs/quickstart-tp3.yaml": "model.layers.*.mlp.down_proj     rowwise",
    "hf-scale plan configs/quickstart-pp2.yaml": "pipeline parallel over 2 ranks",
    "hf-scale plan configs/quickstart.yaml --gpus 4": "recommended:",
}
TRAINS = "trains the real SmolLM2 on 2 CPU processes: minutes"
NOT_RUN = {
    "make demo": f"{TRAINS} (about 6); .ci/run runs it",
    "make test": "the whole suite, this test included: .ci/run runs it",
    "hf-scale finetune configs/quickstart.yaml --parallel.strategy zero2 --train.lr 1e-4":
        f"{TRAINS}; tests/integration/test_cli.py trains every strategy on tiny recipes",
    "hf-scale finetune configs/quickstart.yaml --data.packing bfd --train.report_to tensorboard":
        f"{TRAINS}; tests/distributed/test_packing.py and tests/unit/test_trackers.py test both options",
    "hf-scale finetune configs/chat-sft.yaml":
        f"{TRAINS}; tests/unit/test_chat_*.py test its data, tests/distributed/test_packing.py its packing",
    "hf-scale finetune configs/long-context.yaml":
        f"{TRAINS} (about 8 on 2 cores); tests/integration/test_cli_cp.py trains cp=2 on packed rows against one process",
    "hf-scale finetune configs/quickstart.yaml --resume latest":
        "needs a run's checkpoint, then trains: minutes; tests/integration/test_cli.py resumes mid-epoch",
    "hf-scale finetune configs/quickstart-lora.yaml":
        f"{TRAINS}; tests/integration/test_real_models.py runs this recipe end to end",
    "hf-scale finetune configs/quickstart-qlora.yaml":
        f"{TRAINS}; tests/integration/test_cli_qlora.py runs a tiny recipe with model.quantize: nf4 on 2 ranks",
    "hf-scale finetune configs/quickstart-pp2.yaml":
        f"{TRAINS}; tests/integration/test_pp_real.py trains SmolLM2 at pp=2 against one process",
    "hf-scale generate zoo:smollm2 --tp 3 --prompt 'What is 12 + 30?' --max-new-tokens 32":
        "starts 3 torchrun workers that each load SmolLM2; tests/integration/test_tp_real.py runs this example",
    "hf-scale plan Qwen/Qwen3-30B-A3B --gpus 16 --ep 8 --strategy fsdp":
        "reads the model's config.json from the Hub, and tests never reach the network",
    "hf-scale plan meta-llama/Llama-3.1-70B --gpus 64 --gpu-memory 80GB --seq 4096 --batch 1":
        "reads the model's config.json from the Hub, and tests never reach the network",
    "hf-scale export ckpt/latest out/":
        "needs a training run's checkpoint; tests/unit/test_export.py runs the export command",
    "hf-scale push out/ my-org/my-finetune --private":
        "uploads to the Hub; tests/hub/test_push.py runs the push command against tests/hub_server.py",
}


def _normal(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```language blocks of a Markdown text."""
    return re.findall(rf"^```{language}[ \t]*\n(.*?)^```[ \t]*$", text, re.MULTILINE | re.DOTALL)


def readme_commands(text: str) -> list[str]:
    """Each command line of the ```bash blocks (comments dropped, continuations joined)."""
    commands = []
    for block in fenced_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                commands.append(_normal(line))
    return commands


def test_every_readme_command_is_run_or_not_run_with_a_reason():
    commands = readme_commands(README.read_text())
    run, not_run = {_normal(c) for c in RUN}, {_normal(c): why for c, why in NOT_RUN.items()}
    assert not run & set(not_run), "a command is both run and not run"
    unchecked = [c for c in commands if c not in run and c not in not_run]
    assert not unchecked, (f"README commands neither run by this test nor listed in NOT_RUN with a reason: "
                           f"{unchecked}; add each to RUN (cheap: seconds) or to NOT_RUN (say why)")
    stale = sorted((run | set(not_run)) - set(commands))
    assert not stale, f"no longer in the README, remove from RUN / NOT_RUN: {stale}"
    assert all(why.strip() for why in not_run.values())


@pytest.fixture(scope="module")
def readme_runs() -> dict[str, subprocess.CompletedProcess]:
    """Each RUN command run to its end, two at a time (each is mostly a process start and imports)."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def run(command: str) -> subprocess.CompletedProcess:
        words = shlex.split(command)
        assert words[0] == "hf-scale", f"RUN knows how to start hf-scale only, not {words[0]!r}"
        return subprocess.run([sys.executable, "-m", "hf_scale.cli", *words[1:]], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240, check=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RUN, pool.map(run, RUN)))


@pytest.mark.slow  # plan reads the real SmolLM2's config (its zoo copy is de-quantized once, ~30 s)
@pytest.mark.parametrize("command", list(RUN))
def test_cheap_readme_commands_exit_0(readme_runs, command):
    done = readme_runs[command]
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert RUN[command] in done.stdout, f"{command} printed:\n{done.stdout[-3000:]}"


def test_the_quickstart_is_the_two_commands_ci_runs():
    text = README.read_text()
    quickstart = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    assert readme_commands(quickstart) == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and "make demo" in ci  # .ci/run calls the README's commands as written
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)


def test_the_readme_is_a_short_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, f"README.md is {len(text.splitlines())} lines"
    assert text.startswith("# hf_scale\n\n") and not text.split("\n\n", 2)[1].startswith("#")  # what it is, first
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert headings[:2] == ["Quickstart", "At a glance"] and headings[-1] == "Documentation"
    listed = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", text.split("\n## Documentation\n")[1]))
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert listed == pages, f"the Documentation list lacks {pages - listed} / names missing {listed - pages}"


def _outside_code(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-',
    '-1', '-2', ... on repeats."""
    slugs, repeats = set(), {}
    for line in _outside_code(text):
        found = re.match(r"^#{1,6} +(.+?) *#*$", line)
        if found:
            slug = re.sub(r"[^\w\- ]", "", found[1].lower()).replace(" ", "-")
            n = repeats[slug] = repeats.get(slug, -1) + 1
            slugs.add(f"{slug}-{n}" if n else slug)
    return slugs


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links outside code that are not URLs."""
    targets = []
    for line in _outside_code(text):
        line = re.sub(r"`[^`]*`", "", line)  # inline code: `[x](y)` there is no link
        targets += [t for t in re.findall(r"\]\(([^)\s]+)\)", line) if not re.match(r"[a-z]+:", t)]
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings_that_exist(page):
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchors_follow_github():
    assert anchors("# A\n## The GPU path (`scripts/gpu_check.py`)\n```\n# not a heading\n```\n## A\n") == {
        "a", "the-gpu-path-scriptsgpu_checkpy", "a-1"}
    assert relative_links("[x](a.md#b) `[no](c.md)` [web](https://x.org) [`code`](d.md)\n```\n[no](e.md)\n```") == [
        "a.md#b", "d.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_parse(page):
    for block in fenced_blocks(page.read_text(), "python"):
        ast.parse(block)
