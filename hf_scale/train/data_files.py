"""Local data files (``data.path`` / ``data.eval_path``): find them, load them with ``datasets``,
and when they cannot be read say which file, which line and what to do.

``datasets`` reports a broken file as ``DatasetGenerationError: An error occurred while
generating the dataset`` with pyarrow's or pandas' error as its cause, and an empty JSON Lines
file as a bare ``StopIteration``. Here a path that does not exist, an empty file and a file
that does not parse are each one :class:`~hf_scale.errors.HfScaleConfigError`; a file that
failed is read again with Python's own ``json`` / ``csv`` to find the first bad line (only on
that failure).

Usage::

    splits = load_data_files("data/train.jsonl", "data.path")     # DatasetDict(train=...)
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
from pathlib import Path

from ..errors import HfScaleConfigError

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
GLOB_CHARS = "*?["
FIXES = {
    ".jsonl": 'each line of a .jsonl file must be one whole JSON object, e.g. {"prompt": "...", "response": "..."}',
    ".json": "a .json file holds one JSON list of objects, or one JSON object per line",
    ".csv": "a .csv file needs a header row, as many fields in every row, and quotes around fields holding commas",
}


def is_local(path: str) -> bool:
    """A path to local files (not a Hub dataset name): it exists, is a glob, starts with ``.``
    or ``/``, or ends with a data file's suffix (``data/train.jsonl``)."""
    return (Path(path).exists() or any(ch in path for ch in GLOB_CHARS) or path.startswith((".", "/", "~"))
            or Path(path).suffix in BUILDERS)


def data_files(path: str, key: str) -> list[str]:
    """The data files ``path`` names (a file, a folder's files or a glob), sorted; ``key`` is the
    config field that set it. Refuses a path that names none, and files of mixed types."""
    path = os.path.expanduser(path)
    files = sorted(glob.glob(os.path.join(path, "*")) if Path(path).is_dir() else glob.glob(path))
    files = [f for f in files if Path(f).suffix in BUILDERS]
    kinds = f"{', '.join(sorted(BUILDERS))} files"
    if not files and not Path(path).exists() and not any(ch in path for ch in GLOB_CHARS):
        raise HfScaleConfigError(f"{key}={path!r}: no such file or folder. Give a file, folder or glob of {kinds}.")
    if not files:
        raise HfScaleConfigError(f"{key}={path!r} matches no data file; give a file, folder or glob of {kinds}.")
    if len({BUILDERS[Path(f).suffix] for f in files}) > 1:
        suffixes = ", ".join(sorted({Path(f).suffix for f in files}))
        raise HfScaleConfigError(f"{key}={path!r} mixes file types ({suffixes}): use one.")
    for f in files:
        if _blank(f):
            raise HfScaleConfigError(f"{key}: the data file {f!r} is empty: write the examples into it, or point {key} "
                                     "at the file that holds them.")
    return files


def _blank(path: str) -> bool:
    """Empty, or white space only (read only when small)."""
    size = os.path.getsize(path)
    if size > 65536:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def load_data_files(path: str, key: str = "data.path"):
    """``DatasetDict(train=...)`` of the files ``path`` names (:func:`data_files`)."""
    from datasets import load_dataset
    from datasets.utils import logging as datasets_logging

    files = data_files(path, key)
    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(logging.CRITICAL)  # its "Failed to load JSON from file" lines, on every rank
    try:
        return load_dataset(BUILDERS[Path(files[0]).suffix], data_files={"train": files})
    except Exception as e:  # noqa: BLE001 - datasets wraps pyarrow's and pandas' errors in its own
        raise unreadable(files, key, e) from None
    finally:
        datasets_logging.set_verbosity(verbosity)


def unreadable(files: list[str], key: str, error: BaseException) -> HfScaleConfigError:
    """The error for ``files`` that ``datasets`` failed to read with ``error``: the first file
    and line Python's parsers refuse, else the deepest cause ``datasets`` gave."""
    for f in files:
        problem = bad_line(f)
        if problem:
            return HfScaleConfigError(f"{key}: cannot read the data file {f!r}: {problem}. Fix the file "
                                      f"({FIXES[Path(f).suffix]}).")
    cause = error
    while cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__):
        cause = cause.__cause__ or cause.__context__
    said = " ".join(str(cause).split()) or type(cause).__name__
    where = repr(files[0]) if len(files) == 1 else f"{len(files)} files ({files[0]!r}, ...)"
    fix = FIXES.get(Path(files[0]).suffix, "check that the file is complete and of its suffix's type")
    return HfScaleConfigError(f"{key}: cannot read the data in {where}: {said}. Fix the file ({fix}).")


def bad_line(path: str) -> str | None:
    """Where (and why) Python's ``json`` / ``csv`` refuse the file, or None (or not JSON / CSV)."""
    suffix = Path(path).suffix
    try:
        if suffix in (".json", ".jsonl"):
            return _json_problem(path)
        if suffix == ".csv":
            return _csv_problem(path)
    except (OSError, UnicodeDecodeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _json_problem(path: str) -> str | None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):  # one JSON document
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"line {e.lineno}, column {e.colno}: {_said(e)}" + (" (the file ends early: cut short?)"
                                                                   if e.pos >= len(text.rstrip()) else "")
        return None
    rows = text.splitlines()
    for number, line in enumerate(rows, 1):  # JSON Lines
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            cut_short = number == len(rows) and not text.endswith("\n")
            cut = " (the file ends inside this line: cut short?)" if cut_short else ""
            return f"line {number}, column {e.colno}: {_said(e)}{cut}"
        if not isinstance(value, dict):
            return f"line {number}: a JSON {type(value).__name__}, not an object of named columns"
    return None


def _csv_problem(path: str) -> str | None:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, strict=True)
        try:
            header = next(reader, None)
            if not header:
                return "line 1: no header row (the column names)"
            for row in reader:
                if len(row) > len(header):
                    return f"line {reader.line_num}: {len(row)} fields, but the header names {len(header)}"
        except csv.Error as e:
            unclosed = " (a quote opened and never closed)" if "end of data" in str(e) else ""
            return f"line {reader.line_num}: {e}{unclosed}"
    return None


def _said(error: json.JSONDecodeError) -> str:
    return error.msg.removesuffix(" starting at")  # "Unterminated string starting at" (its position follows)
