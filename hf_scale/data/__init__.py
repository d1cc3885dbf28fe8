"""Data for training, usable from a user's own loop as well as from ``hf-scale finetune``.

- :mod:`hf_scale.data.chat`: conversations rendered with the tokenizer's chat template, the loss
  on the assistant turns only.
- :mod:`hf_scale.data.packing`: whole examples placed into rows best-fit-decreasing, documents
  kept apart by ``position_ids`` that restart at 0; the padding-free collator.

Nothing here imports ``datasets`` or ``torch.distributed`` at import time.
"""
