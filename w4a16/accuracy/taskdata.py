"""The embedded tasks' data, generated deterministically from a seed and shipped as JSONL in `regression/tasks/data/`.

Two tasks sized for a 135M-parameter instruct model, so the gate measures something on a model that small:
- `w4a16_arith` (generate-until, gsm8k's answer format): one-step word problems over small numbers whose answers
  end in `#### <number>`; scored by exact match on the extracted number, like gsm8k.
- `w4a16_facts` (log-likelihood, multiple choice): next/previous number, opposites, capitals, animal sounds and
  colours, four choices each (chance = 0.25).

`python -m w4a16.accuracy.taskdata [DIR]` rewrites the shipped files; a test checks they are what this produces.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20260
# docs per task and split; "train" feeds the few-shot examples, "test" is what is scored (the gate limits it
# further). The facts task has about 250 distinct questions, so its splits stay well below that.
SPLITS = {"w4a16_arith": {"train": 16, "test": 200}, "w4a16_facts": {"train": 16, "test": 150}}

NAMES = ("Sam", "Mia", "Tom", "Ana", "Ben", "Lia", "Max", "Eva", "Leo", "Zoe", "Ian", "Amy")
THINGS = ("apples", "books", "pencils", "cookies", "marbles", "stickers", "cards", "shells")


def _add(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    verb = rng.choice(("buys", "finds", "gets"))
    question = f"{name} has {a} {thing}. {name} {verb} {b} more. How many {thing} does {name} have now?"
    return {"question": question, "answer": f"{name} has {a} + {b} = {a + b} {thing}.\n#### {a + b}"}


def _subtract(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(6, 15)
    b = rng.randint(1, a - 2)
    verb = rng.choice(("gives away", "loses", "sells"))
    question = f"{name} has {a} {thing}. {name} {verb} {b} of them. How many {thing} does {name} have left?"
    return {"question": question, "answer": f"{name} has {a} - {b} = {a - b} {thing} left.\n#### {a - b}"}


def _multiply(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    question = f"{name} has {a} boxes. Each box holds {b} {thing}. How many {thing} does {name} have in all?"
    return {"question": question, "answer": f"{name} has {a} * {b} = {a * b} {thing}.\n#### {a * b}"}


OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad", "day": "night", "open": "closed",
    "wet": "dry", "tall": "short", "old": "new", "light": "dark", "full": "empty", "hard": "soft", "early": "late",
    "left": "right", "win": "lose", "yes": "no", "in": "out", "push": "pull", "black": "white",
}  # fmt: skip
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid",
    "England": "London", "Russia": "Moscow", "China": "Beijing", "Egypt": "Cairo", "Greece": "Athens",
    "Canada": "Ottawa", "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna", "Norway": "Oslo",
}  # fmt: skip
SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "pig": "oink", "owl": "hoot"}
COLOURS = {
    "the sky on a clear day": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
    "a ripe tomato": "red", "an orange": "orange", "a lemon": "yellow", "milk": "white", "a leaf": "green",
}  # fmt: skip


def _pick(rng: random.Random, answer: str, pool: list[str]) -> dict:
    """Four choices: the answer and three distinct distractors from `pool`, in a seeded order."""
    distractors = rng.sample(sorted(set(pool) - {answer}), 3)
    choices = [answer, *distractors]
    rng.shuffle(choices)
    return {"choices": choices, "label": choices.index(answer)}


def _fact(rng: random.Random) -> dict:
    kind = rng.choice(("next", "previous", "opposite", "capital", "sound", "colour"))
    if kind in ("next", "previous"):
        n = rng.randint(2, 99)
        answer = n + 1 if kind == "next" else n - 1
        pool = [str(answer + d) for d in (-3, -2, 2, 3, 5, 10)]
        question = f"Which number comes {'after' if kind == 'next' else 'before'} {n}?"
        return {"question": question, **_pick(rng, str(answer), pool + [str(answer)])}
    table, text = {
        "opposite": (OPPOSITES, "What is the opposite of {}?"),
        "capital": (CAPITALS, "What is the capital of {}?"),
        "sound": (SOUNDS, "What sound does a {} make?"),
        "colour": (COLOURS, "What colour is {}?"),
    }[kind]
    key = rng.choice(sorted(table))
    return {"question": text.format(key), **_pick(rng, table[key], list(table.values()))}


def generate(seed: int = SEED) -> dict[str, dict[str, list[dict]]]:
    """{task: {split: [doc, ...]}}; the same seed always gives the same docs (no global RNG state is used)."""
    rng = random.Random(seed)
    makers = {"w4a16_arith": lambda r: r.choice((_add, _subtract, _multiply))(r), "w4a16_facts": _fact}
    data: dict[str, dict[str, list[dict]]] = {}
    for task, make in makers.items():
        seen: set[str] = set()
        data[task] = {}
        for split, count in SPLITS[task].items():
            docs = []
            for _ in range(100 * count):  # distinct questions, and no test question among the few-shot ones
                if len(docs) == count:
                    break
                doc = make(rng)
                if doc["question"] not in seen:
                    seen.add(doc["question"])
                    docs.append(doc)
            if len(docs) < count:
                raise RuntimeError(f"{task}/{split}: only {len(docs)} distinct docs of the {count} asked for")
            data[task][split] = docs
    return data


def to_jsonl(docs: list[dict]) -> str:
    return "".join(json.dumps(doc, sort_keys=True) + "\n" for doc in docs)


def write(directory: Path, seed: int = SEED) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, splits in generate(seed).items():
        for split, docs in splits.items():
            path = directory / f"{task}.{split}.jsonl"
            path.write_text(to_jsonl(docs), encoding="utf-8")
            paths.append(path)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "regression/tasks/data"
    for written in write(target):
        print(written)
