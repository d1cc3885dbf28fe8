"""Replace one generated section of a document: the text between two HTML-comment markers.

A benchmark script that prints a table writes it into the docs with::

    python scripts/bench_parallelize.py --legs hf_fsdp,torch_fsdp --write docs/benchmarks.md

which calls :func:`write_section` on the section ``<!-- bench:NAME:start -->`` ...
``<!-- bench:NAME:end -->``. Only the text between the two marker lines changes; every other byte
of the file stays as it was. By hand (the text on stdin)::

    python scripts/write_doc.py docs/benchmarks.md parallelize < table.md
"""

from __future__ import annotations

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
    endings outside the section stay as they are."""
    path = Path(path)
    document = path.read_bytes().decode("utf-8")
    path.write_bytes(replace_section(document, name, body).encode("utf-8"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} DOCUMENT SECTION_NAME < new_text")
    try:
        write_section(sys.argv[1], sys.argv[2], sys.stdin.read())
    except (MarkerError, OSError) as e:
        sys.exit(str(e))
