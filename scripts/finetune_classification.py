"""Fine-tune an encoder for sequence classification with any parallel layout.

    torchrun --nproc_per_node 2 scripts/finetune_classification.py --config configs/minilm-classification.yaml

Any recipe field can be overridden with ``--section.field value``; ``--resume latest``
continues from the newest checkpoint. Without torchrun it launches its own workers, like
``hf-scale finetune``. The loop, data and metrics live in ``hf_scale.train``.
"""

import sys

from hf_scale.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]], task="sequence_classification"))
