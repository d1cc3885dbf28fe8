"""Fine-tune a causal LM (instruction pairs or plain text) with any parallel layout.

    torchrun --nproc_per_node 2 scripts/finetune_clm.py --config configs/quickstart.yaml
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        scripts/finetune_clm.py --config configs/llama3-8b-fsdp.yaml --train.lr 1e-5

Any recipe field can be overridden with ``--section.field value``; ``--resume latest``
continues from the newest checkpoint. Without torchrun it launches its own workers, like
``hf-scale finetune``. The loop, data and metrics live in ``hf_scale.train``.
"""

import sys

from hf_scale.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]], task="causal_lm"))
