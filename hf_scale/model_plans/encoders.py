"""Registry entries for encoder models whose transformers declarations do not fit FSDP units.

* BERT and RoBERTa declare their ``*Embeddings`` as no-split modules too. As a unit of its own
  the embedding would split the word embedding from the MLM decoder it is tied to, and it is
  small, so only the layers are units.
* DistilBERT declares no no-split modules at all.
"""

from .base import register_plan

register_plan("bert", wrap_modules=("BertLayer",))
register_plan("roberta", wrap_modules=("RobertaLayer",))
register_plan("distilbert", wrap_modules=("TransformerBlock",))
