"""Export a training checkpoint as a clean Hub-format folder.

    python scripts/export_checkpoint.py ckpt/latest out/ [--tokenizer NAME_OR_PATH]
    torchrun --nproc_per_node 4 scripts/export_checkpoint.py ckpt/step_00001200 out/

Copies the model shards, config and checksums of the checkpoint (verifying every sha256) and,
optionally, a tokenizer; optimizer and RNG state are left out. Loads with
``AutoModelForCausalLM.from_pretrained(out)``.
"""

import argparse

import torch.distributed as dist

from hf_scale.checkpoint.export import export_checkpoint
from hf_scale.distributed import init_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step_* folder, or <root>/latest")
    parser.add_argument("out")
    parser.add_argument("--tokenizer", default=None, help="tokenizer to save beside the model")
    args = parser.parse_args()
    init_distributed()
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"exported to {export_checkpoint(args.checkpoint, args.out, tokenizer)}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
