"""A chat template that inflates every prompt past data.max_prompt_length: rows are dropped as they
render, so the dataset never holds every rendered row (peak memory measured with tracemalloc), and
`--check` refuses in one line when the first rows all render over the limit.

    python -m pytest -q tests/faults/test_inflating_template.py
"""
from __future__ import annotations

import json
import tracemalloc

import pytest

from megarl.data.config import DataConfig
from megarl.data.dataset import RLDataset
from tests.helpers.reward import text_tokenizer

REPEATS = 2000
# Each prompt rendered REPEATS times: a 64-character prompt becomes 128 kB of text.
INFLATING = ("{% for m in messages %}{% for _ in range(" + str(REPEATS) + ") %}{{ m['content'] }}{% endfor %}"
             "{% endfor %}")


def _rows(path, n: int) -> str:
    path.write_text("".join(json.dumps({"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"{i:064d}"}],
                                        "reward_model": {"ground_truth": "1"}}) + "\n" for i in range(n)))
    return str(path)


def test_rows_over_the_limit_are_dropped_as_they_render_not_held(tmp_path):
    files = _rows(tmp_path / "train.jsonl", 200)           # 200 rows x 128 kB rendered = 25.6 MB if held
    tok = text_tokenizer()
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"no usable train prompts .*'filtered_overlong': 200"):
            RLDataset(files, tok, DataConfig(max_prompt_length=64, chat_template=INFLATING))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB while rendering"


def test_rows_that_fit_are_all_kept_across_tokenizer_chunks(tmp_path):
    files = _rows(tmp_path / "train.jsonl", 600)           # more than one TOKENIZE_ROWS chunk
    ds = RLDataset(files, text_tokenizer(), DataConfig(max_prompt_length=200, chat_template="plain"))
    assert ds.report["kept"] == 600 and [it["index"] for it in ds.items] == list(range(600))
    assert ds.items[599]["raw_prompt"][0]["content"] == f"{599:064d}"


def test_check_refuses_in_one_line_when_the_sampled_rows_all_render_over_the_limit(tmp_path):
    from megarl.config import ConfigError
    from megarl.launcher.preflight_data import SAMPLED_ROWS, check_first_rows
    files = [_rows(tmp_path / "train.jsonl", 5000)]
    with pytest.raises(ConfigError) as err:
        check_first_rows(DataConfig(max_prompt_length=64, chat_template=INFLATING), files, text_tokenizer(),
                         "train", None)
    line = str(err.value)
    assert "\n" not in line and line.startswith("data.train_files: ")
    assert f"all {SAMPLED_ROWS} prompts sampled across {files[0]} render to more than data.max_prompt_length=64" in line
    check_first_rows(DataConfig(max_prompt_length=200, chat_template="plain"), files, text_tokenizer(), "train", None)


def test_check_does_not_refuse_a_file_whose_first_rows_only_are_long(tmp_path):
    from megarl.launcher.preflight_data import check_first_rows
    path = tmp_path / "sorted.jsonl"
    rows = [{"prompt": "x" * 300 if i < 100 else "short", "reward_model": {"ground_truth": "1"}} for i in range(400)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))           # longest first, as a sorted file is
    check_first_rows(DataConfig(max_prompt_length=64, chat_template="plain"), [str(path)], text_tokenizer(), "train",
                     None)
