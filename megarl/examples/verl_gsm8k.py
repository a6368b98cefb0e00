"""Parquet files in exactly the shape of verl's GSM8K preprocessing (examples/data_preprocess/gsm8k.py),
with made-up word problems instead of the hub data set (no download here):

    python -m megarl.examples.verl_gsm8k data/verl_gsm8k [--train 256 --test 32 --seed 0]

Each row: data_source "openai/gsm8k"; prompt [{role: user, content: question + verl's instruction}];
ability "math"; reward_model {style: rule, ground_truth: "<number>"}; extra_info {split, index,
answer, question}. megarl reads verl's real files the same way (configs/verl_gsm8k_tiny.yaml).
"""
from __future__ import annotations

import argparse
import os
import random

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Natalia", "Weng", "Betty", "James", "Julie", "Albert", "Ken", "Alexis")
THINGS = ("clips", "apples", "books", "stickers", "pencils", "marbles")


def problem(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    question = f"{name} had {a} {thing} and got {b} more. How many {thing} does {name} have now?"
    answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n#### {a + b}"
    return question, answer, a + b


def rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"{split}-{seed}")
    out = []
    for index in range(count):
        question, answer, result = problem(rng)
        out.append({"data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(result)},
                    "extra_info": {"split": split, "index": index, "answer": answer, "question": question}})
    return out


def write(out_dir: str, train: int = 256, test: int = 32, seed: int = 0) -> tuple[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, count in (("train", train), ("test", test)):
        path = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows(split, count, seed)), path)
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--test", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("wrote", *write(args.out_dir, args.train, args.test, args.seed))


if __name__ == "__main__":
    main()
