"""Command-line parsing shared by every ``hf-scale`` command (and ``python -m hf_scale.hub``).

Errors are one line (an :class:`HfScaleConfigError`, which the commands print and exit 2 on),
flags are taken only as spelled (no abbreviations), and an unknown flag names the closest known
one. Kept apart from ``cli.py`` so the library's ``hub/push_command.py`` can use it without importing the
application.

Usage::

    parser = ArgumentParser(prog="hf-scale export")
    parser.add_argument("--tokenizer")
    ns = parser.parse_strict(["--tokeniser", "gpt2"])  # HfScaleConfigError: ... did you mean --tokenizer?
"""

from __future__ import annotations

import argparse
import difflib

from .errors import HfScaleConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one-line :class:`HfScaleConfigError` (exit 2 through ``main``),
    and which takes flags only as spelled (no abbreviations), as finetune's launch flags."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise HfScaleConfigError(f"{message}. See {self.prog} --help.")

    def parse_strict(self, args: list[str]) -> argparse.Namespace:
        """Parse ``args``; an unknown flag is an error naming the closest known one."""
        ns, extras = self.parse_known_args(args)
        if extras:
            flags = (s for a in self._actions for s in a.option_strings)
            known = [s for s in flags if s.startswith("--") and s != "--help"]
            raise unknown_argument(extras[0], known, self.prog)
        return ns


def unknown_argument(arg: str, known: list[str], prog: str, also: str = "") -> HfScaleConfigError:
    """The error for an argument ``prog`` does not take: the closest known flag, else the list."""
    if not arg.startswith("-"):
        return HfScaleConfigError(f"unexpected argument {arg!r}. See {prog} --help.")
    flag = arg.partition("=")[0]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"{prog} takes {', '.join(known)}{also}."
    return HfScaleConfigError(f"unknown flag {flag}: {hint} See {prog} --help.")
