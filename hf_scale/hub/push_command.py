"""``hf-scale push FOLDER REPO_ID``: :func:`push_to_hub` from the command line.

A PEFT adapter folder gets an adapter model card (``hub/card.py``) unless it has a card of its
own. The token comes from ``HF_TOKEN`` or ``hf auth login`` (never from a flag: command lines are
visible to other users of the machine), the Hub from ``HF_ENDPOINT``.

Usage (``python -m hf_scale.hub`` runs the same)::

    hf-scale push out/ my-org/my-finetune --private --revision v1 --allow-pattern "*.safetensors"
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..errors import HfScaleError
from ..strict_args import ArgumentParser
from .upload import push_to_hub


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, push, print the commit URL; return 0, or 2 after a one-line error (as every hf-scale command)."""
    parser = ArgumentParser(
        prog="hf-scale push",
        description="Upload a checkpoint folder written by hf_scale.save_pretrained, or a PEFT "
        "adapter folder written by PeftModel.save_pretrained (given an adapter model card), to the "
        "Hub. Resumable: files already on the Hub are not sent again.",
    )
    parser.add_argument("folder", help="checkpoint folder (config.json, safetensors shards, ...) "
                        "or PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("repo_id", help="Hub repo, e.g. my-org/my-finetune (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="branch to push to (created from main if new)")
    parser.add_argument("--allow-pattern", action="append", dest="allow_patterns", metavar="GLOB",
                        help="push only files matching GLOB (repeatable)")
    parser.add_argument("--commit-message", help="message of the commit(s)")
    try:
        args = parser.parse_strict(list(sys.argv[1:] if argv is None else argv))
        url = push_to_hub(args.folder, args.repo_id, private=args.private, revision=args.revision,
                          allow_patterns=args.allow_patterns, commit_message=args.commit_message)
    except HfScaleError as e:
        print(f"hf-scale push: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(url)
    return 0
