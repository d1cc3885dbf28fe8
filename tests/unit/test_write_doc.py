"""scripts/write_doc.py: benchmark scripts replace their section of the docs between markers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from write_doc import MarkerError, replace_section, write_section

from hf_scale.errors import HfScaleError

DOC = (
    "# Benchmarks\r\n\nintro, kept as is  \n"
    "<!-- bench:a:start -->\nold table A\nold line\n<!-- bench:a:end -->\n"
    "between\t\n"
    "<!-- bench:b:start -->\nchecksums: hand-written, not ours\n<!-- bench:b:end -->\n"
    "tail without newline"
)


def test_replaces_only_between_markers_and_keeps_every_other_byte():
    out = replace_section(DOC, "a", "| new | table |\n|---|---|")
    start, end = "<!-- bench:a:start -->\n", "<!-- bench:a:end -->"
    assert out == DOC.replace("old table A\nold line\n", "| new | table |\n|---|---|\n")
    before, rest = out.split(start)
    assert before == DOC.split(start)[0]  # byte-identical, \r\n and trailing spaces included
    assert rest.split(end)[1] == DOC.split(end)[1]  # section b and the tail untouched
    assert replace_section(out, "a", "old table A\nold line\n") == DOC  # and back


def test_empty_body_and_adjacent_markers():
    emptied = replace_section(DOC, "b", "")
    assert "<!-- bench:b:start -->\n\n<!-- bench:b:end -->" in emptied
    assert replace_section(emptied, "b", "x") == replace_section(DOC, "b", "x")


@pytest.mark.parametrize(
    "doc, why",
    [
        (DOC.replace("<!-- bench:a:end -->\n", ""), "0 time"),
        (DOC.replace("<!-- bench:a:start -->\n", ""), "0 time"),
        (DOC + "\n<!-- bench:a:start -->\n", "2 time"),
        ("<!-- bench:a:end -->\nx\n<!-- bench:a:start -->\n", "comes before"),
        ("<!-- bench:a:start --> x <!-- bench:a:end -->\n", "lines of their own"),
    ],
)
def test_bad_markers_fail_clearly(doc, why):
    with pytest.raises(MarkerError, match=why) as info:
        replace_section(doc, "a", "new")
    assert isinstance(info.value, HfScaleError)
    assert "section 'a'" in str(info.value)


def test_missing_section_names_the_markers_to_add():
    with pytest.raises(MarkerError, match="<!-- bench:zzz:start -->.*<!-- bench:zzz:end -->"):
        replace_section(DOC, "zzz", "new")


def test_write_section_and_command_line(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_bytes(DOC.encode())
    write_section(doc, "b", "measured\n")
    assert doc.read_bytes() == DOC.replace("checksums: hand-written, not ours", "measured").encode()
    script = [sys.executable, str(SCRIPTS / "write_doc.py")]
    done = subprocess.run([*script, str(doc), "a"], input="from stdin", text=True, check=False,
                          capture_output=True)
    assert done.returncode == 0, done.stderr
    assert "<!-- bench:a:start -->\nfrom stdin\n<!-- bench:a:end -->" in doc.read_text()
    missing = subprocess.run([*script, str(doc), "nope"], input="x", text=True, check=False,
                             capture_output=True)
    assert missing.returncode != 0 and "bench:nope:start" in missing.stderr


PAGE = (
    "# Benchmarks\n<!-- bench:summary:start -->\nstale\n<!-- bench:summary:end -->\n"
    "## Speed\n<!-- bench:speed:start -->\nWritten by `python scripts/x.py` on 2026-11-25 01:46 UTC; ...\n"
    "| a | b |\n(a) FAIL: tok/s 0.95x (need >= 1.0x)\nPASS: rss 0.9x (need <= 1.0x)\n"
    "<!-- bench:speed:end -->\nFAIL: prose outside a section is not a verdict\n"
)
TESTS_PAGE = ("# Tests\n\nprose\n\n## How long CI takes\n"
              "<!-- bench:ci:start -->\n```\nPASS: make test 24.0 min (need <= 25 min)\n```\n<!-- bench:ci:end -->\n")
FRONT = "# README\n## At a glance\n<!-- bench:summary:start -->\n<!-- bench:summary:end -->\n## Examples\n"


def _site(root: Path) -> tuple[Path, Path]:
    """A README and a docs/ folder like the repository's: the benchmarks page, the tests page
    (the CI timing) and a page without generated sections."""
    docs = root / "docs"
    docs.mkdir(parents=True)
    (docs / "benchmarks.md").write_text(PAGE)
    (docs / "tests.md").write_text(TESTS_PAGE)
    (docs / "layouts.md").write_text("# Layouts\n\nFAIL: prose, no section\n")
    (root / "README.md").write_text(FRONT)
    return docs, root / "README.md"


def test_summaries_collect_the_verdicts_of_every_generated_section(tmp_path):
    from write_doc import refresh_summaries, verdicts

    assert [(r["section"], r["verdict"], r["date"]) for r in verdicts(PAGE)] == [
        ("speed", "FAIL", "2026-11-25"), ("speed", "PASS", "2026-11-25")]
    docs, front = _site(tmp_path)
    page = docs / "benchmarks.md"
    refresh_summaries(docs, front)
    summary = page.read_text().split("<!-- bench:summary:end -->")[0]
    assert "| speed | **no** | tok/s 0.95x (need >= 1.0x) | 2026-11-25 |" in summary
    assert "| speed | yes | rss 0.9x (need <= 1.0x) | 2026-11-25 |" in summary
    assert "stale" not in summary and "prose" not in summary
    assert "make test" not in summary  # the benchmarks page lists its own targets only
    table = front.read_text().split("<!-- bench:summary:end -->")[0]
    assert "| Speed | speed | 1 of 2 | tok/s 0.95x (need >= 1.0x) | 2026-11-25 |" in table
    assert "| How long CI takes | ci | 1 of 1 | - | not dated |" in table  # from docs/tests.md
    assert "prose" not in table
    assert "sections of [docs/benchmarks.md](docs/benchmarks.md) and [docs/tests.md](docs/tests.md)," in table
    refresh_summaries(docs, front)
    assert front.read_text().split("<!-- bench:summary:end -->")[0] == table  # stable
    assert front.read_text().endswith("<!-- bench:summary:end -->\n## Examples\n")  # the rest kept


def test_a_write_into_any_docs_page_refreshes_the_readme_summary(tmp_path, monkeypatch):
    """time_ci.py writes docs/tests.md: the README's At a glance table follows."""
    import write_doc

    docs, front = _site(tmp_path)
    monkeypatch.setattr(write_doc, "DOCS", docs)
    monkeypatch.setattr(write_doc, "README", front)
    write_section(docs / "tests.md", "ci", "```\nFAIL: make test 26.0 min (need <= 25 min)\n```\n")
    assert "| How long CI takes | ci | 0 of 1 | make test 26.0 min (need <= 25 min) |" in front.read_text()
    elsewhere = tmp_path / "other.md"  # not the README, not under docs/: no refresh
    elsewhere.write_text(TESTS_PAGE)
    before = front.read_text()
    write_section(elsewhere, "ci", "```\nPASS: make test 1.0 min (need <= 25 min)\n```\n")
    assert front.read_text() == before


def test_the_repository_summaries_are_what_the_pages_say(tmp_path):
    """The committed README and docs/benchmarks.md summaries equal a fresh refresh from the
    generated sections where they live now (the CI timing in docs/tests.md)."""
    import shutil

    from write_doc import DOCS, README, refresh_summaries

    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(README, tmp_path / "README.md")
    refresh_summaries(tmp_path / "docs", tmp_path / "README.md")
    assert (tmp_path / "README.md").read_bytes() == README.read_bytes(), "run python scripts/write_doc.py --summaries"
    assert (tmp_path / "docs" / "benchmarks.md").read_bytes() == (DOCS / "benchmarks.md").read_bytes()
    assert "<!-- bench:ci:start -->" in (DOCS / "tests.md").read_text()  # time_ci.py's section moved
    assert "<!-- bench:ci:start -->" not in README.read_text()


def test_time_ci_reads_pytest_and_judges_the_limits():
    from time_ci import pytest_summary, report, slowest

    log = ("a traceback that says slowest\n0.1s call tests/not_a_duration.py\n"
           "....\n=== slowest 15 durations ===\n120.50s call     tests/a.py::test_x\n3.00s setup    tests/b.py::t\n"
           "976 passed, 2 skipped, 1 warning in 1519.12s (0:25:19)\n...\n3 passed in 4.20s\n")
    assert pytest_summary(log) == ("976 passed, 2 skipped, 1 warning", 1519.12)
    assert slowest(log) == ["120.50s call     tests/a.py::test_x", "3.00s setup    tests/b.py::t"]
    text = report("abc1234", 41 * 60, 0, log)
    assert "FAIL: make test 25.3 min (need <= 25 min)" in text
    assert "PASS: .ci/run 41.0 min, exit 0 (need exit 0 in <= 50 min)" in text
    assert "FAIL: .ci/run 41.0 min, exit 2" in report("abc1234", 41 * 60, 2, log)
