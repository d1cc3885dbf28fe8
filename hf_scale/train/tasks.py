"""Generated question/answer tasks whose success is measurable: ``data.path: builtin:<name>``.

Each task is a pure function of its seed, so every rank (and every run) builds the same
examples; the held-out ``test`` split shares no question with ``train``.

Usage::

    splits = builtin_dataset("builtin:arithmetic")      # DatasetDict(train=..., test=...)
    splits["train"][0]   # {"prompt": "What is 37 + 48?", "response": "85"}
    builtin_dataset("builtin:topics")["train"][0]     # {"text": "...", "label": "sports"}
    builtin_dataset("builtin:multiturn")["train"][0]  # {"messages": [{"role": "user", ...}, ...]}
    builtin_dataset("builtin:preference")["train"][0]  # {"prompt": ..., "chosen": "85", "rejected": "58"}
    builtin_dataset("builtin:unpaired")["train"][0]    # {"prompt": ..., "completion": "85", "label": True}
"""

from __future__ import annotations

import random

from ..errors import HfScaleConfigError

PREFIX = "builtin:"


def arithmetic(rng: random.Random) -> dict:
    """Two-digit addition or subtraction, answered with the number only."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return {"prompt": f"What is {a} + {b}?", "response": str(a + b)}
    a, b = max(a, b), min(a, b)
    return {"prompt": f"What is {a} - {b}?", "response": str(a - b)}


def preference(rng: random.Random) -> dict:
    """An arithmetic question with the right answer chosen and a near miss rejected: off by 1 to
    10, or the answer's digits swapped, never negative nor the answer itself."""
    question = arithmetic(rng)
    answer = int(question["response"])
    digits = str(answer)
    swapped = int(digits[::-1]) if len(digits) == 2 else answer
    if swapped != answer and rng.random() < 0.3:
        wrong = swapped
    else:
        offset = rng.randint(1, 10)
        wrong = answer - offset if answer - offset >= 0 and rng.random() < 0.5 else answer + offset
    return {"prompt": question["prompt"], "chosen": str(answer), "rejected": str(wrong)}


def reverse_word(rng: random.Random) -> dict:
    """Spell a short lowercase word backwards."""
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
    return {"prompt": f"Reverse the letters of '{word}'.", "response": word[::-1]}


_TOPICS = {
    "sports": ["the striker scored twice", "the team won the final", "a marathon runner set a record",
               "the coach praised the defence", "the match went to penalties"],
    "weather": ["heavy rain is expected", "the storm closed the roads", "a heatwave hit the city",
                "snow fell overnight", "strong winds toppled trees"],
    "food": ["the soup needs more salt", "she baked fresh bread", "the restaurant serves noodles",
             "we grilled vegetables", "the dessert was too sweet"],
}
_OPENERS = ["", "Today ", "Reports say ", "Yesterday ", "Apparently ", "Locals said "]
_CLOSERS = [".", " again.", " this week.", ", people say.", " in the north.", " after all."]


def topics(rng: random.Random) -> dict:
    """A short sentence about sports, weather or food, labelled with its topic."""
    label = rng.choice(sorted(_TOPICS))
    return {"text": rng.choice(_OPENERS) + rng.choice(_TOPICS[label]) + rng.choice(_CLOSERS), "label": label}


# Follow-up steps of a multi-turn calculation: (short wording, long wording, the operation).
_STEPS = [
    ("Add {k} to that.", "Take the number you just gave me and add {k} to it. What do you get?",
     lambda x, k: x + k),
    ("Subtract {k} from that.", "Now take that result and subtract {k} from it. What is left?",
     lambda x, k: x - k),
    ("Now double it.", "Good. Please double the number from your last answer. What is it now?",
     lambda x, k: 2 * x),
    ("Multiply that by {k}.", "Next, multiply your previous answer by {k}. What is the product?",
     lambda x, k: x * k),
]
# Long conversations open with one of these and add an aside to each follow-up.
_PREAMBLES = [
    ("I am checking my homework and I want to be sure of every single step before I hand it in "
     "tomorrow morning, so please work through this with me carefully. "),
    ("We are going to do a short calculation together, one step at a time, and each step builds on "
     "the answer before it, so keep the running total in mind as we go. "),
    ("Here is a small puzzle about numbers that my friend gave me during lunch today; it has a few "
     "parts, and I would like the answer to each part with the number only, nothing else. "),
]
_ASIDES = [
    "Right, I got the same number when I worked it out on paper a minute ago, so we agree. ",
    "Thanks, that matches what I wrote down. ",
    "Great, I think I am following so far, but let me keep going to be sure. ",
    "Okay, my notebook agrees with you on that one. ",
]


def multiturn(rng: random.Random) -> dict:
    """A conversation of 1-4 user/assistant turns: a two-digit sum or difference, then steps that
    act on the previous answer ("Add 7 to that.", "Now double it."), answered with the number
    only. Short and long wordings make the longest conversations about ten times as long as the
    shortest."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    long = rng.random() < 0.5
    if rng.random() < 0.5:
        question, value = f"What is {a} + {b}?", a + b
    else:
        a, b = max(a, b), min(a, b)
        question, value = f"What is {a} - {b}?", a - b
    if long:
        question = rng.choice(_PREAMBLES) + question
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": str(value)}]
    for _ in range(rng.randint(0, 3)):
        short, verbose, step = rng.choice(_STEPS[:2] if value > 500 else _STEPS)
        k = rng.randint(2, 5) if "{k}" in short and "Multiply" in short else rng.randint(1, 20)
        if step(value, k) < 0:
            short, verbose, step = _STEPS[0]
        value = step(value, k)
        wording = rng.choice(_ASIDES) + verbose if long else short
        messages += [{"role": "user", "content": wording.format(k=k)}, {"role": "assistant", "content": str(value)}]
    return {"messages": messages}


TASKS = {"arithmetic": arithmetic, "reverse": reverse_word, "topics": topics, "multiturn": multiturn,
         "preference": preference}
SIZES = {"topics": (240, 60)}  # (train, test): it has 270 distinct sentences


def builtin_dataset(path: str, seed: int = 1234):
    """``DatasetDict(train, test)`` of distinct examples of a generated task."""
    from datasets import Dataset, DatasetDict

    name = path[len(PREFIX):]
    if name == "unpaired":  # kto: the pairs unpaired (chosen True, rejected False), then shuffled so
        from ..data.unpaired import unpair_preference  # that the first N rows hold both labels

        pairs = builtin_dataset(PREFIX + "preference", seed)
        return DatasetDict({split: unpair_preference(ds).shuffle(seed=seed).flatten_indices()
                            for split, ds in pairs.items()})
    if name not in TASKS:
        raise HfScaleConfigError(
            f"data.path={path!r}: unknown generated task {name!r}; choose one of "
            f"{', '.join(PREFIX + t for t in (*TASKS, 'unpaired'))}."
        )
    make, rng = TASKS[name], random.Random(seed)
    train_size, test_size = SIZES.get(name, (4000, 200))
    seen: dict[str, dict] = {}
    for _ in range(50 * (train_size + test_size)):
        example = make(rng)
        seen.setdefault(repr(next(iter(example.values()))), example)  # distinct questions / conversations
        if len(seen) == train_size + test_size:
            break
    rows = list(seen.values())
    return DatasetDict(train=Dataset.from_list(rows[test_size:]), test=Dataset.from_list(rows[:test_size]))
