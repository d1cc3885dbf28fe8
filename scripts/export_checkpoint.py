"""Export a training checkpoint as a clean Hub-format folder (the same as ``hf-scale export``).

    python scripts/export_checkpoint.py ckpt/latest out/ [--tokenizer NAME_OR_PATH]
    torchrun --nproc_per_node 4 scripts/export_checkpoint.py ckpt/step_00001200 out/

Copies the model shards, config and checksums of the checkpoint (verifying every sha256) and,
optionally, a tokenizer; optimizer and RNG state are left out. Loads with
``AutoModelForCausalLM.from_pretrained(out)``.
"""

import sys

from hf_scale.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
