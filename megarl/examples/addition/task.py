"""The quickstart's verifiable task: multi-digit addition, `"123+45="` -> `"168"` then EOS.

    python -m megarl.examples.addition.task --out data/addition     # rewrite the shipped files

Rows use verl's format (`prompt` as chat messages, `data_source`, `reward_model.ground_truth`),
so the quickstart exercises the same data path as a real dataset. Everything is deterministic
in the seed; validation problems never appear in the training or warm-start problems.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

DATA_SOURCE = "addition"


@dataclass(frozen=True)
class AdditionTask:
    """Operands have `min_digits`..`max_digits` digits each (uniform in the digit count first,
    so short and long numbers are equally common).

    The long-tailed variant (`long_fraction` > 0): that share of problems has two `long_digits`
    operands instead, so most answers are a few tokens and a few are near the response limit, the
    shape that makes a batch wait on its longest responses (benchmarks/async_speedup.py --longtail)."""
    min_digits: int = 1
    max_digits: int = 2
    long_digits: int = 0
    long_fraction: float = 0.0

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not 0.0 <= self.long_fraction < 1.0 or (self.long_fraction > 0 and self.long_digits <= self.max_digits):
            raise ValueError(f"need 0 <= long_fraction < 1 and, when it is > 0, long_digits > max_digits; got "
                             f"long_fraction={self.long_fraction}, long_digits={self.long_digits}")

    def operand(self, rng: random.Random, digits: int | None = None) -> int:
        digits = rng.randint(self.min_digits, self.max_digits) if digits is None else digits
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10 ** digits - 1)

    def problems(self, seed: int, exclude: AbstractSet[tuple[int, int]] = frozenset()) -> Iterator[tuple[int, int]]:
        """An endless deterministic stream of (a, b), skipping `exclude`."""
        rng = random.Random(seed)
        while True:
            # the draw for the tail happens only when there is one, so the short task's stream is unchanged
            long = self.long_digits if self.long_fraction and rng.random() < self.long_fraction else None
            pair = (self.operand(rng, long), self.operand(rng, long))
            if pair not in exclude:
                yield pair

    def max_prompt_chars(self) -> int:
        return 2 * max(self.max_digits, self.long_digits) + 2

    def max_answer_chars(self) -> int:
        return max(self.max_digits, self.long_digits) + 1


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def make_row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer_text(a, b)},
        "extra_info": {"split": split, "index": index},
    }


def take_unique(stream: Iterator[tuple[int, int]], count: int, exclude: set) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    seen = set(exclude)
    if count <= 0:
        return out
    for pair in stream:
        if pair in seen:
            continue
        seen.add(pair)
        out.append(pair)
        if len(out) == count:
            return out
    return out


VAL_SEED, TRAIN_SEED, SFT_SEED = 7001, 7002, 7003


def split_problems(task: AdditionTask, n_train: int, n_val: int) -> tuple[list, list]:
    val = take_unique(task.problems(VAL_SEED), n_val, set())
    train = take_unique(task.problems(TRAIN_SEED), n_train, set(val))
    return train, val


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_dataset(out_dir: str, task: AdditionTask = AdditionTask(), n_train: int = 3000,
                  n_val: int = 512) -> tuple[str, str]:
    train, val = split_problems(task, n_train, n_val)
    train_path, val_path = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "val.jsonl")
    write_jsonl(train_path, [make_row(a, b, "train", i) for i, (a, b) in enumerate(train)])
    write_jsonl(val_path, [make_row(a, b, "val", i) for i, (a, b) in enumerate(val)])
    return train_path, val_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/addition")
    parser.add_argument("--min-digits", type=int, default=AdditionTask.min_digits)
    parser.add_argument("--max-digits", type=int, default=AdditionTask.max_digits)
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--val", type=int, default=512)
    parser.add_argument("--long-digits", type=int, default=0)
    parser.add_argument("--long-fraction", type=float, default=0.0)
    args = parser.parse_args(argv)
    task = AdditionTask(args.min_digits, args.max_digits, args.long_digits, args.long_fraction)
    paths = write_dataset(args.out, task, args.train, args.val)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
