"""Inputs that are large and empty: refused in one line, fast, before any expensive work.

- 200,000 prompts (a million go the same way) whose chat messages are all empty: each is judged
  before the chat template renders it (nothing is tokenised); the file is refused past
  data.max_bad_row_fraction;
- a 50 MB config file: refused by its size before YAML parses it (~1 MB a second).
In-process, ~20 s on 2 loaded cores, most of it writing and reading the rows.
"""
from __future__ import annotations

import time

import pytest

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.data.config import DataConfig
from megarl.data.dataset import RLDataset
from tests.helpers.reward import text_tokenizer


class CountingTokenizer:
    """The test tokenizer, counting calls: an empty prompt must never reach it."""

    def __init__(self):
        self.inner, self.calls = text_tokenizer(), 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.inner, name)


def test_empty_prompts_by_the_hundred_thousand_are_refused_in_one_line_without_tokenising(tmp_path):
    path = tmp_path / "empty.jsonl"
    line = '{"prompt": [{"role": "user", "content": "  "}], "reward_model": {"ground_truth": "1"}}\n'
    path.write_text(line * 200_000)        # 1,000,000 took 95 s wall (~25 s CPU) at load 8, all of it JSON reading
    tok = CountingTokenizer()
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        RLDataset(str(path), tok, DataConfig(train_files=[str(path)], chat_template="plain"))
    seconds = time.monotonic() - start
    text = str(err.value)
    assert "200000 of 200000 rows are malformed" in text and "empty 'prompt'" in text and "\n" not in text
    assert tok.calls <= 5 and seconds < 60, (tok.calls, seconds)      # no row was rendered or tokenised


def test_a_50_mb_config_is_refused_by_its_size_at_once(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "w") as f:
        f.write("trainer:\n  total_epochs: 1\n")
        f.write("".join(f"# padding line {i:08d} " + "x" * 80 + "\n" for i in range(500_000)))
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert time.monotonic() - start < 1.0
    assert "MiB is over the 2 MiB a config file may hold" in str(err.value) and "\n" not in str(err.value)
    # the configs megarl ships and verl's largest tree stay far below it
    assert load_config("configs/quickstart.yaml").trainer.n_gpus_per_node == 2
