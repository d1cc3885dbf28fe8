"""The Hub: upload checkpoint folders (:func:`push_to_hub`) with model cards (:func:`write_model_card`).

Both take a PEFT adapter folder (``PeftModel.save_pretrained``'s) too: its card follows the
Hub's adapter conventions (``hub/adapter.py``).

Usage::

    hf_scale.save_pretrained(model, "out/", tokenizer=tok)
    hf_scale.write_model_card("out/", hf_scale.CardInfo(base_model="gpt2", strategy="fsdp"))
    hf_scale.push_to_hub("out/", "my-org/my-finetune", private=True)
"""

from .card import CardInfo, write_model_card
from .push_command import main
from .upload import push_to_hub

__all__ = ["CardInfo", "main", "push_to_hub", "write_model_card"]
