"""Tiny models of every covered architecture, built from their config classes, and batches.

Hidden size 32, 2 layers, vocabulary 128, dropout off (so a parallel run and one process see
the same function). Each architecture lists the task heads users fine-tune on it.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 128
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
_ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)

CAUSAL, SEQCLS, SEQ2SEQ = "causal", "seqcls", "seq2seq"
AUTO = {
    CAUSAL: tf.AutoModelForCausalLM,
    SEQCLS: tf.AutoModelForSequenceClassification,
    SEQ2SEQ: tf.AutoModelForSeq2SeqLM,
}

# arch -> (config class, config kwargs, heads)
ARCHS = {
    "llama": (tf.LlamaConfig, dict(_DECODER, num_key_value_heads=2, tie_word_embeddings=True), (CAUSAL, SEQCLS)),
    "mistral": (tf.MistralConfig, dict(_DECODER, num_key_value_heads=2), (CAUSAL, SEQCLS)),
    "qwen2": (tf.Qwen2Config, dict(_DECODER, num_key_value_heads=2), (CAUSAL, SEQCLS)),
    "gemma": (tf.GemmaConfig, dict(_DECODER, num_key_value_heads=2, head_dim=8), (CAUSAL, SEQCLS)),
    "phi3": (tf.Phi3Config, dict(_DECODER, num_key_value_heads=2), (CAUSAL, SEQCLS)),
    "gpt2": (tf.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64), (CAUSAL, SEQCLS)),
    "gpt_neox": (tf.GPTNeoXConfig, dict(_DECODER, max_position_embeddings=64), (CAUSAL, SEQCLS)),
    "opt": (tf.OPTConfig, dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, word_embed_proj_dim=32, max_position_embeddings=64), (CAUSAL, SEQCLS)),
    "bert": (tf.BertConfig, _ENCODER, (SEQCLS,)),
    "roberta": (tf.RobertaConfig, dict(_ENCODER, max_position_embeddings=70), (SEQCLS,)),
    "distilbert": (tf.DistilBertConfig, dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_position_embeddings=64), (SEQCLS,)),
    "t5": (tf.T5Config, dict(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=VOCAB), (SEQ2SEQ, SEQCLS)),
}
NUM_LABELS = 3
# Other shapes of an architecture, for the tests that need them (not in all_cases()).
VARIANTS = {
    "phi3_mha": ("phi3", dict(num_key_value_heads=4)),  # q, k, v of equal size: packed qkv under tp
    "llama_vocab129": ("llama", dict(vocab_size=VOCAB + 1)),  # a vocabulary tp=2 does not divide
}


def tiny_config(arch: str):
    arch, extra = VARIANTS.get(arch, (arch, {}))
    cls, kwargs, _ = ARCHS[arch]
    config = cls(**{**kwargs, **extra})
    for key in list(config.to_dict()):
        if "dropout" in key or "pdrop" in key:
            setattr(config, key, 0.0)
    config.pad_token_id = 0
    config.bos_token_id = config.eos_token_id = 1
    config.decoder_start_token_id = 0
    config.num_labels = NUM_LABELS
    return config


def tiny_model(arch: str, head: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised tiny ``arch`` model with the ``head`` task head (fp32)."""
    torch.manual_seed(seed)
    return AUTO[head].from_config(tiny_config(arch))


def tiny_batch(head: str, batch: int, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch with no padding, so every sequence (and every rank's slice) has as many tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    ids[:, -1] = 1  # eos: T5's classifier reads the last eos
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if head == CAUSAL:
        out["labels"] = ids.clone()
    elif head == SEQCLS:
        out["labels"] = torch.randint(0, NUM_LABELS, (batch,), generator=g)
    else:
        out["labels"] = torch.randint(2, VOCAB, (batch, seq // 2), generator=g)
    return out


def packed_batch(batch: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """``batch`` (causal) as packed rows: each row holds documents of random lengths, kept apart by
    ``position_ids`` that restart at 0, the label of each document's first token ignored (no
    prediction across a boundary), and no attention mask (transformers finds the documents from
    the positions only then)."""
    g = torch.Generator().manual_seed(seed)
    rows, seq = batch["input_ids"].shape
    positions = torch.empty(rows, seq, dtype=torch.long)
    labels = batch["labels"].clone()
    for r in range(rows):
        cuts = sorted(torch.randperm(seq - 2, generator=g)[:2].add(1).tolist())  # 3 documents
        starts = [0, *cuts]
        for a, b in zip(starts, [*cuts, seq]):
            positions[r, a:b] = torch.arange(b - a)
            labels[r, a] = -100
    return {"input_ids": batch["input_ids"], "position_ids": positions, "labels": labels}


# ------------------------------------------------------------------ packing

SLIDING = 4  # Gemma3's sliding window, shorter than the documents: the window works inside each


def packing_model(arch: str) -> tf.PreTrainedModel:
    """A tiny causal LM of ``arch`` (llama, qwen3, gemma3_text) for the packing tests, its config's
    ``use_cache`` left on as saved checkpoints have it (a cache turns transformers' packed-document
    detection off: hf_scale's forwards of packed batches pass ``use_cache=False``), weights drawn
    10x wider than the default so that attention is sharp (a leak shows)."""
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128,
                  initializer_range=0.2)  # sharper attention than the default 0.02: a leak shows
    config = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=SLIDING,
                                                   layer_types=["sliding_attention", "full_attention"]),
    }[arch]()
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def packing_examples(n: int = 7, seed: int = 0) -> list[dict]:
    """Examples of 5-14 tokens whose first 0-4 (a prompt, or none: plain text) are not trained."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 15, (1,), generator=g))
        ids = torch.randint(2, 128, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, 5, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out



def slice_batch(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s contiguous part of a global batch."""
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def all_cases() -> list[tuple[str, str]]:
    return [(arch, head) for arch, (_, _, heads) in ARCHS.items() for head in heads]


# ------------------------------------------------------------------ fine-tuning jobs

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-=?.,'\n:!_"


def tiny_tokenizer(chat_template: bool = True):
    """A character-level fast tokenizer (ids < VOCAB) with ChatML special tokens.

    Ids 0/1 are pad/eos as in :func:`tiny_config`; ``<|im_end|>`` ends a chat turn.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(_CHARS))}
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    if chat_template:
        tok.chat_template = CHATML
    return tok


def save_tiny_checkpoint(folder, arch: str = "llama", head: str = CAUSAL, seed: int = 0, **config_fields) -> str:
    """A tiny pretrained model + tokenizer saved as a Hub-format folder; returns its path.
    ``config_fields`` override the tiny config's (e.g. ``initializer_range=0.2``)."""
    torch.manual_seed(seed)
    config = tiny_config(arch)
    for key, value in config_fields.items():
        setattr(config, key, value)
    if hasattr(config, "max_position_embeddings"):  # room for chat-formatted examples
        config.max_position_embeddings = max(config.max_position_embeddings, 128)
    model = AUTO[head].from_config(config)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def tiny_recipe(root, steps: int = 4, sharp: bool = False, **sections):
    """A fine-tuning recipe (YAML) for a tiny Llama on generated arithmetic; returns its path.

    ``sections`` update the recipe's sections, e.g. ``hub={"push": True, "repo_id": "o/r"}``.
    ``sharp``: weights drawn 10x wider than the default, so that attention is sharp and a
    document attending to another in a packed row changes the loss well beyond the tolerances
    (at the default width the leak moves it by less than 1e-5).
    """
    from pathlib import Path

    import yaml

    root = Path(root)
    model = save_tiny_checkpoint(root / "tiny-llama", "llama", CAUSAL, **({"initializer_range": 0.2} if sharp else {}))
    job = {
        "model": {"name_or_path": model},
        "data": {"path": "builtin:arithmetic", "max_train_samples": 48, "max_eval_samples": 10, "max_seq_len": 64},
        "parallel": {"strategy": "fsdp"},
        "train": {"output_dir": str(root / "runs" / "default"), "max_steps": steps, "batch_size": 4,
                  "lr": 3e-3, "eval_batch_size": 4, "progress": False, "sample_generations": 2},
        "launch": {"nproc_per_node": 2},
    }
    for name, values in sections.items():
        job.setdefault(name, {}).update(values)
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def pair_rows(pairs: int, seed: int = 0, max_len: int = 14) -> list[dict]:
    """Tokenised preference pairs as ``tokenize_preference`` gives them: a shared prompt of 3-5
    tokens (labels -100), then a chosen and a rejected completion of different lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(pairs):
        prompt = torch.randint(2, VOCAB, (3 + i % 3,), generator=g).tolist()
        row = {}
        for side, length in (("chosen", max_len - len(prompt) - i % 4), ("rejected", max_len - len(prompt) - 2 - i % 3)):
            completion = torch.randint(2, VOCAB, (max(length, 2),), generator=g).tolist()
            row[f"{side}_input_ids"] = prompt + completion
            row[f"{side}_labels"] = [-100] * len(prompt) + completion
        rows.append(row)
    return rows


def pair_batch(pairs: int = 3, seed: int = 0, max_len: int = 14) -> dict[str, torch.Tensor]:
    """:func:`pair_rows` collated as ``PairCollator`` does (rows interleaved, right padding, pad 0)."""
    from hf_scale.data.preference import PairCollator

    return PairCollator(0)(pair_rows(pairs, seed, max_len))


def unpaired_rows(examples: int, seed: int = 0, max_len: int = 14) -> list[dict]:
    """Tokenised unpaired (KTO) examples as ``tokenize_unpaired`` gives them: a prompt of 3-5
    tokens (labels -100), a completion of varying length, the label False for rows 1, 4, 7, ...
    (undesirable) and True for the others."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(examples):
        prompt = torch.randint(2, VOCAB, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(2, VOCAB, (max(max_len - len(prompt) - i % 4, 2),), generator=g).tolist()
        rows.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion,
                     "label": i % 3 != 1})
    return rows
