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
