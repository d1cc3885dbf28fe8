"""Generated question/answer tasks whose success is measurable: ``data.path: builtin:<name>``.

Each task is a pure function of its seed, so every rank (and every run) builds the same
examples; the held-out ``test`` split shares no question with ``train``.

Usage::

    splits = builtin_dataset("builtin:arithmetic")      # DatasetDict(train=..., test=...)
    splits["train"][0]   # {"prompt": "What is 37 + 48?", "response": "85"}
    builtin_dataset("builtin:topics")["train"][0]     # {"text": "...", "label": "sports"}
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


TASKS = {"arithmetic": arithmetic, "reverse": reverse_word, "topics": topics}
SIZES = {"topics": (240, 60)}  # (train, test): it has 270 distinct sentences


def builtin_dataset(path: str, seed: int = 1234):
    """``DatasetDict(train, test)`` of distinct examples of a generated task."""
    from datasets import Dataset, DatasetDict

    name = path[len(PREFIX):]
    if name not in TASKS:
        raise HfScaleConfigError(
            f"data.path={path!r}: unknown generated task {name!r}; choose one of "
            f"{', '.join(PREFIX + t for t in TASKS)}."
        )
    make, rng = TASKS[name], random.Random(seed)
    train_size, test_size = SIZES.get(name, (4000, 200))
    seen: dict[str, dict] = {}
    for _ in range(50 * (train_size + test_size)):
        example = make(rng)
        seen.setdefault(next(iter(example.values())), example)  # distinct questions / texts
        if len(seen) == train_size + test_size:
            break
    rows = list(seen.values())
    return DatasetDict(train=Dataset.from_list(rows[test_size:]), test=Dataset.from_list(rows[:test_size]))
