"""Replace one generated section of a document: the text between two HTML-comment markers.

A benchmark script that prints a table writes it into the docs with::

    python scripts/bench_parallelize.py --legs hf_fsdp,torch_fsdp --write docs/benchmarks.md

which calls :func:`write_section` on the section ``<!-- bench:NAME:start -->`` ...
``<!-- bench:NAME:end -->``. Only the text between the two marker lines changes; every other byte
of the file stays as it was. By hand (the text on stdin)::

    python scripts/write_doc.py docs/benchmarks.md parallelize < table.md

Every generated section lives on the page of its topic: the benchmarks' tables in
``docs/benchmarks.md``, the CI timing (``scripts/time_ci.py``) in ``docs/tests.md``. Every write
into a page under ``docs/`` or into ``README.md`` also re-writes the two ``summary`` sections
(:func:`refresh_summaries`) from the verdict lines (``PASS ...`` / ``FAIL ...``, each script prints
its targets so) of the generated sections: the benchmarks page's (one row per target of that
page) and the README's "At a glance" table (one row per section of every page), the table a
newcomer reads first. By hand: ``python scripts/write_doc.py --summaries``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from hf_scale.errors import HfScaleError


class MarkerError(HfScaleError, ValueError):
    """The document lacks a section's markers, has them twice, or in the wrong order."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def replace_section(document: str, name: str, body: str) -> str:
    """``document`` with the text between ``name``'s marker lines replaced by ``body``.

    The marker lines themselves stay; ``body`` gets a trailing newline if it lacks one.
    """
    start, end = markers(name)
    counts = {m: document.count(m) for m in (start, end)}
    if any(n != 1 for n in counts.values()):
        found = ", ".join(f"{m!r} {n} time(s)" for m, n in counts.items())
        raise MarkerError(
            f"section {name!r}: each marker must appear exactly once, found {found}. Add the line "
            f"{start} before the section and {end} after it."
        )
    i, j = document.index(start), document.index(end)
    if j < i:
        raise MarkerError(f"section {name!r}: {end} comes before {start}; swap them.")
    head = document[: document.index("\n", i) + 1] if "\n" in document[i:j] else None
    if head is None:
        raise MarkerError(f"section {name!r}: put {start} and {end} on lines of their own.")
    tail = document[document.rindex("\n", 0, j) + 1 :]
    if not body.endswith("\n"):
        body += "\n"
    return head + body + tail


def write_section(path: str | Path, name: str, body: str) -> None:
    """Replace section ``name`` of the file at ``path`` (UTF-8) in place; bytes, so that line
    endings outside the section stay as they are. A write into a page of the repository's
    ``docs/`` or into its README refreshes both summaries."""
    path = Path(path)
    document = path.read_bytes().decode("utf-8")
    path.write_bytes(replace_section(document, name, body).encode("utf-8"))
    if name != SUMMARY and (path.resolve() == README.resolve() or path.resolve().parent == DOCS.resolve()):
        refresh_summaries(DOCS, README)


ROOT = Path(__file__).resolve().parents[1]
DOCS, README = ROOT / "docs", ROOT / "README.md"
BENCHMARKS = "benchmarks.md"  # the page under docs/ whose own summary lists its every target
SUMMARY = "summary"
_SECTION = re.compile(r"<!-- bench:(?P<name>[\w.-]+):start -->\r?\n(?P<body>.*?)<!-- bench:(?P=name):end -->", re.DOTALL)
_VERDICT = re.compile(r"^(?:\(\w+\) *)?(?P<verdict>PASS|FAIL)\b:? *(?P<text>.+)$")
_WRITTEN = re.compile(r"Written by `[^`]*` on (?P<date>\d{4}-\d\d-\d\d)")


def verdicts(document: str) -> list[dict]:
    """Each generated section's verdict lines: ``{"section", "heading", "verdict", "text",
    "date"}`` (the heading is the ``## `` title above the section, the date its written line's)."""
    rows = []
    for match in _SECTION.finditer(document):
        if match["name"] == SUMMARY:
            continue
        headings = re.findall(r"^## (.+)$", document[: match.start()], re.MULTILINE)
        written = _WRITTEN.search(match["body"])
        for line in match["body"].splitlines():
            found = _VERDICT.match(line.strip())
            if found:
                rows.append({"section": match["name"], "heading": headings[-1] if headings else "",
                             "verdict": found["verdict"], "text": found["text"],
                             "date": written["date"] if written else "not dated"})
    return rows


def _short(text: str, width: int) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def target_table(rows: list[dict]) -> str:
    """One row per target: the benchmarks page's summary."""
    lines = ["| section | met | target and latest figure | written |", "|---|---|---|---|"]
    lines += [f"| {r['section']} | {'yes' if r['verdict'] == 'PASS' else '**no**'} | {_short(r['text'], 110)} "
              f"| {r['date']} |" for r in rows]
    return "\n".join(lines)


def section_table(rows: list[dict]) -> str:
    """One row per section, with the targets it misses: the README's summary."""
    lines = ["| what is measured | section | targets met | not met | written |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["section"] for r in rows):
        mine = [r for r in rows if r["section"] == name]
        missed = "; ".join(_short(r["text"], 60) for r in mine if r["verdict"] == "FAIL") or "-"
        passed = sum(r["verdict"] == "PASS" for r in mine)
        lines.append(f"| {mine[0]['heading']} | {name} | {passed} of {len(mine)} | {missed} | {mine[0]['date']} |")
    return "\n".join(lines)


def summarised_pages(docs: Path = DOCS) -> list[Path]:
    """The pages under ``docs`` whose generated sections the README's summary collects: every
    ``*.md`` there, by name (a page without a generated section adds no row)."""
    return sorted(docs.glob("*.md"))


def refresh_summaries(docs: Path = DOCS, readme: Path = README) -> None:
    """Re-write the ``summary`` sections of ``docs/benchmarks.md`` (every target of that page) and
    ``readme`` (one row per generated section of the README and of every page under ``docs``)
    from their generated sections' verdict lines."""
    benchmarks = docs / BENCHMARKS
    page = benchmarks.read_bytes().decode("utf-8")  # line endings kept
    note = ("Generated by `scripts/write_doc.py` from the PASS / FAIL lines of the generated sections "
            "below, each written by the script its section names; re-written whenever one is.")
    benchmarks.write_bytes(replace_section(page, SUMMARY, f"{note}\n\n{target_table(verdicts(page))}\n").encode("utf-8"))
    front = readme.read_bytes().decode("utf-8")
    rows = verdicts(front)
    sources = ["this README"] if rows else []
    for path in summarised_pages(docs):
        found = verdicts(path.read_bytes().decode("utf-8"))
        if found:
            rows += found
            link = Path(os.path.relpath(path, readme.parent)).as_posix()
            sources.append(f"[{link}]({link})")
    listed = " and ".join([", ".join(sources[:-1]), sources[-1]] if len(sources) > 1 else sources) or "no page"
    note = note.replace("the generated sections below", f"the generated sections of {listed}")
    readme.write_bytes(replace_section(front, SUMMARY, f"{note}\n\n{section_table(rows)}\n").encode("utf-8"))


if __name__ == "__main__":
    if sys.argv[1:] == ["--summaries"]:
        refresh_summaries(DOCS, README)
        sys.exit(0)
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} DOCUMENT SECTION_NAME < new_text")
    try:
        write_section(sys.argv[1], sys.argv[2], sys.stdin.read())
    except (MarkerError, OSError) as e:
        sys.exit(str(e))
