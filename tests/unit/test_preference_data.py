"""Preference pairs to token ids (hf_scale.data.preference): the labels exactly on each completion
and its end-of-turn token, with SmolLM2's real tokenizer and chat template; the three input forms
agree; the collator interleaves pairs; the truncation rule; every bad input refused by name.

Expected texts are written by hand (ChatML), never taken from the function under test: the
prompt part (unlabelled) must be exactly the hand-written prompt with its generation prompt, and
the labelled tokens exactly the completion followed by ``<|im_end|>``. One token more or less on
either side changes a boundary and fails.
"""

from __future__ import annotations

import pytest
import torch

from hf_scale.data.preference import PairCollator, tokenize_preference, truncate_pair
from hf_scale.errors import HfScaleConfigError
from hf_scale.train.config import DataConfig
from hf_scale.train.data import tokenize_causal_lm
from hf_scale.train.tasks import builtin_dataset
from tests.tiny_models import tiny_tokenizer

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from hf_scale.zoo import local_copy

    return AutoTokenizer.from_pretrained(local_copy("zoo:smollm2"))


def dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def prompt_text(question: str, system: str = SMOL_SYSTEM) -> str:
    return f"<|im_start|>system\n{system}{EOT}\n<|im_start|>user\n{question}{EOT}\n<|im_start|>assistant\n"


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def check_side(tok, ids, labels, prompt: str, completion: str) -> None:
    """``ids`` are exactly ``prompt + completion + <|im_end|>``; the labels -100 on the prompt's
    tokens and the ids on every later token."""
    head = ids_of(tok, prompt)
    assert ids == ids_of(tok, prompt + completion + EOT)
    assert labels[: len(head)] == [-100] * len(head)
    assert labels[len(head):] == ids[len(head):]
    assert tok.decode(ids[len(head):]) == completion + EOT


PAIRS = [
    {"prompt": "What is 51 + 23?", "chosen": "74", "rejected": "72"},
    {"prompt": "Name a colour of the sky, please.", "chosen": "Blue, mostly.", "rejected": "Green"},
]


def test_plain_pairs_label_exactly_the_completions(smol):
    out = tokenize_preference(dataset(PAIRS), smol, DataConfig(), 128)
    assert out.column_names == ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    for row, pair in zip(out, PAIRS):
        for side in ("chosen", "rejected"):
            check_side(smol, row[f"{side}_input_ids"], row[f"{side}_labels"], prompt_text(pair["prompt"]), pair[side])


def test_chosen_side_is_what_sft_trains_on_the_same_pair(smol):
    """A DPO or reward run after SFT sees the SFT format: the chosen sequence is SFT's row of
    ``{prompt, response: chosen}``, with a system prompt from the config too."""
    cfg = DataConfig(system_prompt="Answer with the number only.")
    pref = tokenize_preference(dataset(PAIRS), smol, cfg, 128)
    sft = tokenize_causal_lm(dataset([{"prompt": p["prompt"], "response": p["chosen"]} for p in PAIRS]), smol, cfg, 128)
    assert pref["chosen_input_ids"] == sft["input_ids"] and pref["chosen_labels"] == sft["labels"]
    check_side(smol, pref[0]["rejected_input_ids"], pref[0]["rejected_labels"],
               prompt_text(PAIRS[0]["prompt"], system="Answer with the number only."), "72")


def conversational(pair, system="Be brief."):
    prompt = [{"role": "system", "content": system}, {"role": "user", "content": pair["prompt"]}]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": pair["chosen"]}],
            "rejected": [{"role": "assistant", "content": pair["rejected"]}]}


def test_conversational_and_implicit_prompt_forms(smol):
    rows = [conversational(p) for p in PAIRS]
    out = tokenize_preference(dataset(rows), smol, DataConfig(), 128)
    for row, pair in zip(out, PAIRS):
        for side in ("chosen", "rejected"):
            check_side(smol, row[f"{side}_input_ids"], row[f"{side}_labels"],
                       prompt_text(pair["prompt"], system="Be brief."), pair[side])
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    assert tokenize_preference(dataset(implicit), smol, DataConfig(), 128).to_list() == out.to_list()


def test_multi_turn_prompt_trains_no_prompt_assistant_turn(smol):
    prompt = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
              {"role": "user", "content": "Double it."}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "8"}],
           "rejected": [{"role": "assistant", "content": "6"}]}
    out = tokenize_preference(dataset([row]), smol, DataConfig(), 128)[0]
    head = (f"<|im_start|>system\n{SMOL_SYSTEM}{EOT}\n<|im_start|>user\nWhat is 2 + 2?{EOT}\n<|im_start|>assistant\n4"
            f"{EOT}\n<|im_start|>user\nDouble it.{EOT}\n<|im_start|>assistant\n")
    check_side(smol, out["chosen_input_ids"], out["chosen_labels"], head, "8")
    check_side(smol, out["rejected_input_ids"], out["rejected_labels"], head, "6")


# ------------------------------------------------------------------ collation


def test_collator_interleaves_pads_right_and_carries_reference_logps():
    rows = [{"chosen_input_ids": [5, 6, 7], "chosen_labels": [-100, 6, 7],
             "rejected_input_ids": [5, 6, 8, 9, 10], "rejected_labels": [-100, 6, 8, 9, 10],
             "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5},
            {"chosen_input_ids": [11, 12], "chosen_labels": [-100, 12],
             "rejected_input_ids": [11, 13, 14], "rejected_labels": [-100, -100, 14],
             "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0}]
    batch = PairCollator(0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [5, 6, 8, 9, 10], [11, 12, 0, 0, 0], [11, 13, 14, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100, 6, 8, 9, 10], [-100, 12, -100, -100, -100],
                                        [-100, -100, 14, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert batch["ref_logps"].tolist() == [-1.5, -2.5, -3.0, -4.0]
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["attention_mask"].dtype == torch.long
    assert batch["ref_logps"].dtype == torch.float32
    bare = PairCollator(0)([{k: v for k, v in r.items() if not k.startswith("ref_")} for r in rows])
    assert set(bare) == {"input_ids", "attention_mask", "labels"}


def test_collator_needs_a_pad_id():
    with pytest.raises(HfScaleConfigError, match="pad token"):
        PairCollator(None)


# ------------------------------------------------------------------ truncation


def seq(prompt: int, completion: int, base: int = 0):
    ids = list(range(base, base + prompt + completion))
    return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}


def test_truncation_keeps_the_prompts_end_and_the_completions_start():
    # prompt 10, completions 4 and 6, max 12: the prompt loses 4 from its left, the completions fit.
    (c_ids, c_lab), (r_ids, r_lab), cut = truncate_pair(seq(10, 4), seq(10, 6, base=100), 12)
    assert cut and c_ids == list(range(4, 14)) and r_ids == list(range(104, 116))
    assert c_lab == [-100] * 6 + list(range(10, 14)) and r_lab == [-100] * 6 + list(range(110, 116))
    # a long completion: the prompt keeps max_len // 2 tokens (its end), the completion its start.
    (c_ids, c_lab), (r_ids, _), _ = truncate_pair(seq(10, 30), seq(10, 2, base=100), 12)
    assert c_ids == list(range(4, 10)) + list(range(10, 16)) and c_lab[:6] == [-100] * 6
    assert r_ids == list(range(104, 112))
    # a short prompt is kept whole.
    (c_ids, _), _, _ = truncate_pair(seq(3, 30), seq(3, 2, base=100), 12)
    assert c_ids == list(range(12))
    # nothing to cut.
    (c_ids, _), (r_ids, _), cut = truncate_pair(seq(4, 3), seq(4, 2, base=100), 12)
    assert not cut and c_ids == list(range(7)) and r_ids == list(range(100, 106))


def test_no_pair_is_truncated_to_nothing():
    """The prompt never keeps more than ``max_len // 2`` when cut, so every sequence keeps a label
    after its first token (the shifted loss has something to count), whatever the lengths."""
    for max_len in (2, 3, 5, 8):
        for prompt in (1, 4, 20):
            for completion in (1, 3, 30):
                (ids, labels), _, _ = truncate_pair(seq(prompt, completion), seq(prompt, 1, base=100), max_len)
                assert len(ids) <= max_len and any(t != -100 for t in labels[1:]), (max_len, prompt, completion)


def test_tokenize_preference_truncates_by_the_rule_and_says_so(caplog):
    tok = tiny_tokenizer()  # one token per character
    row = {"prompt": "abcdefghijklmnopqrstuvwxyz" * 2, "chosen": "0123456789", "rejected": "987"}
    with caplog.at_level("INFO", logger="hf_scale"):
        out = tokenize_preference(dataset([row]), tok, DataConfig(), 40)[0]
    full = tokenize_preference(dataset([row]), tok, DataConfig(), 1000)[0]
    n = len(full["chosen_input_ids"]) - len(out["chosen_input_ids"])  # cut from the prompt's left
    assert len(out["chosen_input_ids"]) == 40 and n > 0
    assert out["chosen_input_ids"] == full["chosen_input_ids"][n:]
    assert out["rejected_input_ids"] == full["rejected_input_ids"][n:]
    assert "1 of 1 preference pairs are longer than data.max_seq_len=40" in caplog.text


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("row, words", [
    ({"prompt": "Hi?", "chosen": "Hello", "rejected": None}, "row 0 has no rejected"),
    ({"prompt": None, "chosen": "Hello", "rejected": "Bye"}, "row 0 has no prompt"),
    ({"prompt": "Hi?", "chosen": "Hello", "rejected": "Hello"}, "row 0: chosen and rejected are identical"),
    ({"prompt": "Hi?", "chosen": "  ", "rejected": "Bye"}, "row 0: the chosen \\(column 'chosen'\\) is empty"),
    ({"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [], "rejected": [{"role": "assistant", "content": "B"}]},
     "row 0: the chosen \\(column 'chosen'\\) is empty"),
    ({"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "A"}],
      "rejected": [{"role": "assistant", "content": ""}]}, "row 0: the rejected completion's assistant message is empty"),
    ({"prompt": [{"role": "usr", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "A"}],
      "rejected": [{"role": "assistant", "content": "B"}]}, "row 0 .* has role 'usr'"),
    ({"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "user", "content": "A"}],
      "rejected": [{"role": "assistant", "content": "B"}]}, "row 0 .*has no assistant turn"),
])
def test_bad_rows_are_refused_by_row(row, words):
    rows = [{"prompt": "Fine?", "chosen": "Yes", "rejected": "No"}, row]
    if isinstance(row["prompt"], list):
        rows[0] = conversational({"prompt": "Fine?", "chosen": "Yes", "rejected": "No"})
    with pytest.raises(HfScaleConfigError, match=words.replace("row 0", "row 1")):
        tokenize_preference(dataset(rows), tiny_tokenizer(), DataConfig(), 64)


def test_missing_columns_mixed_forms_and_implicit_prompt_misuse():
    tok = tiny_tokenizer()
    with pytest.raises(HfScaleConfigError, match="row 0: prompt, chosen and rejected must all be strings or all be"):
        tokenize_preference(dataset([{"prompt": [{"role": "user", "content": "Hi?"}], "chosen": "A", "rejected": "B"}]),
                            tok, DataConfig(), 64)
    with pytest.raises(HfScaleConfigError, match="data.rejected_column='rejected': the preference data have no column"):
        tokenize_preference(dataset([{"prompt": "Hi?", "chosen": "Hello"}]), tok, DataConfig(), 64)
    with pytest.raises(HfScaleConfigError, match="data.prompt_column='question'"):
        tokenize_preference(dataset([{"prompt": "a", "chosen": "b", "rejected": "c"}]), tok,
                            DataConfig(prompt_column="question"), 64)
    with pytest.raises(HfScaleConfigError, match="row 0: without a prompt column"):
        tokenize_preference(dataset([{"chosen": "b", "rejected": "c"}]), tok, DataConfig(), 64)
    user = {"role": "user", "content": "Hi?"}
    with pytest.raises(HfScaleConfigError, match="row 0: chosen and rejected share no opening message"):
        tokenize_preference(dataset([{"chosen": [user, {"role": "assistant", "content": "a"}],
                                      "rejected": [{"role": "user", "content": "Yo"},
                                                   {"role": "assistant", "content": "b"}]}]), tok, DataConfig(), 64)
    with pytest.raises(HfScaleConfigError, match="data.loss_on_prompt"):
        tokenize_preference(dataset(PAIRS), tok, DataConfig(loss_on_prompt=True), 64)


def test_named_columns():
    tok = tiny_tokenizer()
    rows = [{"q": "Hi?", "good": "Hello", "bad": "Go"}]
    cfg = DataConfig(prompt_column="q", chosen_column="good", rejected_column="bad")
    named = tokenize_preference(dataset(rows), tok, cfg, 64)
    plain = tokenize_preference(dataset([{"prompt": "Hi?", "chosen": "Hello", "rejected": "Go"}]), tok, DataConfig(), 64)
    assert named.to_list() == plain.to_list()


# ------------------------------------------------------------------ builtin:preference


def test_builtin_preference_pairs():
    splits = builtin_dataset("builtin:preference", seed=7)
    assert builtin_dataset("builtin:preference", seed=7)["train"].to_list() == splits["train"].to_list()
    assert not set(splits["train"]["prompt"]) & set(splits["test"]["prompt"])
    swaps = 0
    for row in splits["train"].to_list() + splits["test"].to_list():
        a, op, b = row["prompt"].removeprefix("What is ").removesuffix("?").split()
        answer = int(a) + int(b) if op == "+" else int(a) - int(b)
        chosen, rejected = int(row["chosen"]), int(row["rejected"])
        assert chosen == answer and rejected != answer and rejected >= 0
        swapped = row["rejected"] == row["chosen"][::-1].lstrip("0")
        swaps += swapped
        assert swapped or 1 <= abs(rejected - answer) <= 10, row
    assert swaps > 100  # both kinds of near miss occur
