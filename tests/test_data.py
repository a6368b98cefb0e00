"""Prompt data: files, chat templates, length limits, malformed rows, shuffling and resume."""
import json
import logging

import pytest

from megarl.config import ConfigError
from megarl.data.build import build_dataset, build_loaders
from megarl.data.config import DataConfig
from megarl.data.dataset import RLDataset
from megarl.data.loader import PromptLoader
from megarl.data.templates import NAMED
from tests.helpers.reward import text_tokenizer


def row(prompt, truth="1", **extra):
    return {"data_source": "gsm8k", "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": truth}, **extra}


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config(**kw):
    kw.setdefault("max_prompt_length", 64)
    return DataConfig(**kw)


def test_jsonl_and_parquet_give_the_same_items(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [row([{"role": "user", "content": f"{i}+1="}], str(i + 1), extra_info={"index": i}) for i in range(5)]
    rows[2]["prompt"] = "2+1="                                   # a plain string prompt
    jl = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows[:2] + rows[3:]), tmp_path / "d.parquet")
    pq_path = str(tmp_path / "d.parquet")
    tok = text_tokenizer()
    a = RLDataset(jl, tok, config(chat_template="plain"))
    b = RLDataset([pq_path], tok, config(chat_template="plain"))
    assert len(a) == 5 and len(b) == 4
    assert a[0]["prompt_token_ids"] == b[0]["prompt_token_ids"] == tok.encode("0+1=")
    assert a[2]["prompt_token_ids"] == tok.encode("2+1=")
    assert b[1]["raw_prompt"] == [{"role": "user", "content": "1+1="}]       # numpy arrays back to lists
    assert a[4]["reward_model"] == {"style": "rule", "ground_truth": "5"} and a[4]["extra_info"] == {"index": 4}
    assert a[4]["data_source"] == "gsm8k"


def test_chat_templates_and_multi_turn_history(tmp_path):
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [row(history)])
    tok = text_tokenizer()
    def text(name):
        return tok.decode(RLDataset(path, tok,
                                    config(chat_template=name, max_prompt_length=512))[0]["prompt_token_ids"])
    chatml = text("chatml")
    # every message of the history is part of the prompt, and the assistant turn is opened
    assert chatml.count("<|im_start|>") == 5 and chatml.endswith("<|im_start|>assistant\n")
    assert "and 3+3?" in chatml and "Be brief." in chatml
    assert text("plain") == "Be brief.\n2+2?\n4\nand 3+3?"
    assert text("llama3").startswith("<|begin_of_text|><|start_header_id|>system")
    assert text("alpaca").endswith("### Instruction:\nand 3+3?\n\n### Response:\n")
    assert text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}") == "[system][user][assistant][user]"
    assert set(NAMED) >= {"chatml", "qwen", "llama3", "alpaca", "plain"}
    with pytest.raises(ConfigError, match="data.chat_template: unknown chat template 'chatlm'; did you mean 'chatml'"):
        text("chatlm")
    with pytest.raises(ConfigError, match="no chat template"):
        text(None)                                                  # this tokenizer ships none


def test_tokenizer_template_and_plain_strings(tmp_path):
    from megarl.examples.addition.model import build_tokenizer
    tok = build_tokenizer()                                           # ships a plain-text template
    path = write_jsonl(tmp_path / "a.jsonl", [row([{"role": "user", "content": "12+3="}]), row("4+5=")])
    ds = RLDataset(path, tok, config())
    assert [ds[i]["prompt_token_ids"] for i in range(2)] == [tok.encode("12+3="), tok.encode("4+5=")]


def test_overlong_prompts_filtered_or_truncated(tmp_path):
    tok = text_tokenizer()
    path = write_jsonl(tmp_path / "l.jsonl", [row("abcdefghij"), row("abc"), row("0123456789xyz")])
    kw = dict(chat_template="plain", max_prompt_length=8)
    ds = RLDataset(path, tok, config(**kw, filter_overlong_prompts=True))
    assert len(ds) == 1 and ds.report["filtered_overlong"] == 2
    def keep(mode):
        return [tok.decode(it["prompt_token_ids"]) for it in
                RLDataset(path, tok, config(**kw, filter_overlong_prompts=False, truncation=mode)).items]
    assert keep("left") == ["cdefghij", "abc", "56789xyz"]
    assert keep("right") == ["abcdefgh", "abc", "01234567"]
    assert keep("middle") == ["abcdghij", "abc", "01239xyz"]
    ds = RLDataset(path, tok, config(**kw, filter_overlong_prompts=False, truncation="left"))
    assert ds.report["truncated"] == 2
    with pytest.raises(ValueError, match=r"l.jsonl line 1: prompt has 10 tokens, over data.max_prompt_length=8"):
        RLDataset(path, tok, config(**kw, filter_overlong_prompts=False, truncation="error"))


BAD_LINES = ['{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}',        # bad JSON
             '{"question": "no prompt key"}',
             '{"prompt": 5}',
             '{"prompt": [{"role": "user"}]}',
             '["a", "list"]',
             '{"prompt": "x", "reward_model": "2"}']


def test_malformed_rows_are_skipped_with_line_numbers(tmp_path, caplog):
    good = [row(f"{i}+0=", str(i)) for i in range(24)]
    path = write_jsonl(tmp_path / "m.jsonl", good, BAD_LINES)
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        ds = RLDataset(path, text_tokenizer(), config(chat_template="plain", max_bad_row_fraction=0.25))
    assert len(ds) == 24 and ds.report["malformed"] == 6 and ds.report["rows"] == 30
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    msg = warnings[0]
    for expected in ("skipped 6 malformed of 30 rows", "line 25 (bad JSON", "line 26 (missing 'prompt')",
                     "line 27 ('prompt' must be a string", "line 28 ('prompt'[0] must be {role",
                     "line 29 (not an object but list)", "line 30 ('reward_model' must be an object"):
        assert expected in msg, msg


def test_too_many_malformed_rows_stop_with_one_line(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [row("1+1=")] * 4, BAD_LINES[:2])
    with pytest.raises(ValueError) as info:
        RLDataset(path, text_tokenizer(), config(chat_template="plain", max_bad_row_fraction=0.1))
    msg = str(info.value)
    assert "m.jsonl: 2 of 6 rows are malformed, more than data.max_bad_row_fraction=0.1" in msg
    assert "line 5 (bad JSON" in msg and "line 6 (missing 'prompt')" in msg and "\n" not in msg


def test_json_array_and_missing_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([row("1+1="), 7, row("2+2=")]))
    ds = RLDataset(str(tmp_path / "a.json"), text_tokenizer(), config(chat_template="plain", max_bad_row_fraction=0.5))
    assert len(ds) == 2 and ds.report["malformed"] == 1
    with pytest.raises(ConfigError, match="data file not found"):
        RLDataset(str(tmp_path / "nope.jsonl"), text_tokenizer(), config())
    with pytest.raises(ConfigError, match="unsupported file type .csv"):
        (tmp_path / "x.csv").write_text("a,b\n")
        RLDataset(str(tmp_path / "x.csv"), text_tokenizer(), config())


def test_ground_truth_fallbacks(tmp_path):
    rows = [{"prompt": "a", "ground_truth": "1"}, {"prompt": "b", "answer": 2}, {"prompt": "c"}]
    ds = RLDataset(write_jsonl(tmp_path / "g.jsonl", rows), text_tokenizer(), config(chat_template="plain"))
    assert [it["reward_model"]["ground_truth"] for it in ds.items] == ["1", 2, None]


def loader_for(tmp_path, n=10, bs=3, seed=5):
    path = write_jsonl(tmp_path / "s.jsonl", [row(f"{i}=", str(i)) for i in range(n)])
    ds = RLDataset(path, text_tokenizer(), config(chat_template="plain"))
    return PromptLoader(ds, batch_size=bs, shuffle=True, seed=seed)


def indices(batch):
    return [int(i) for i in batch.non_tensor_batch["index"]]


def test_shuffle_is_deterministic_per_epoch_and_drops_the_last_partial_batch(tmp_path):
    a, b = loader_for(tmp_path), loader_for(tmp_path)
    epoch0 = [indices(x) for x in a]
    assert epoch0 == [indices(x) for x in b] and len(epoch0) == 3          # 10 rows, 3 per batch
    flat = sum(epoch0, [])
    assert len(set(flat)) == 9 and flat != sorted(flat)
    epoch1 = [indices(x) for x in a]
    assert epoch1 != epoch0 and a.epoch == 1
    other_seed = loader_for(tmp_path, seed=6)
    assert [indices(x) for x in other_seed] != epoch0


def test_resume_sees_exactly_the_same_batches(tmp_path):
    ref = loader_for(tmp_path)
    seq = [indices(ref.next_batch()) for _ in range(8)]                   # crosses two epoch boundaries
    run = loader_for(tmp_path)
    for _ in range(4):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))                      # survives a JSON checkpoint
    resumed = loader_for(tmp_path)
    resumed.load_state_dict(state)
    assert [indices(resumed.next_batch()) for _ in range(4)] == seq[4:]
    uids = resumed.next_batch().non_tensor_batch["uid"]
    assert len(set(uids)) == 3
    with pytest.raises(ValueError, match="batch_size=3 but this run has 4"):
        loader_for(tmp_path, bs=4).load_state_dict(state)


def test_batch_larger_than_data_is_refused(tmp_path):
    with pytest.raises(ValueError, match="train_batch_size=20 is larger than the 10 usable prompts"):
        loader_for(tmp_path, bs=20)


def test_build_loaders_from_config(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [row(f"{i}=") for i in range(8)])
    val = write_jsonl(tmp_path / "v.jsonl", [row(f"{i}=") for i in range(5)])
    cfg = DataConfig(train_files=train, val_files=[val], train_batch_size=4, chat_template="plain")
    tr, va = build_loaders(cfg, text_tokenizer())
    assert tr.batches_per_epoch == 2 and va.batches_per_epoch == 1
    assert indices(next(iter(va))) == [0, 1, 2, 3, 4]


CUSTOM_DATASET = '''
import torch
from torch.utils.data import Dataset

class CustomEnvDataset(Dataset):
    """As verl's training code does: input_ids/attention_mask from the tokenizer, plus environment state."""
    def __init__(self, data_files, tokenizer, config):
        self.tok = tokenizer
        self.n = 4

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        tokens = self.tok("state" + str(idx), return_tensors="pt", padding="max_length", max_length=8)
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                "prompt": "state" + str(idx), "state": torch.tensor([idx, idx + 1.0]),
                "expected_action": "a" * idx, "index": idx}
'''


def test_custom_dataset_class_as_in_seed_001(tmp_path):
    (tmp_path / "env_dataset.py").write_text(CUSTOM_DATASET)
    cfg = DataConfig(train_files=["unused"], train_batch_size=2, shuffle=False,
                     custom_cls={"path": str(tmp_path / "env_dataset.py"), "name": "CustomEnvDataset"})
    tok = text_tokenizer()
    loader, _ = build_loaders(cfg, tok)
    batch = loader.next_batch()
    assert batch.batch["state"].tolist() == [[0.0, 1.0], [1.0, 2.0]]             # stacked for data.batch['state']
    assert list(batch.non_tensor_batch["expected_action"]) == ["", "a"]
    assert batch.non_tensor_batch["prompt_token_ids"][1] == tok.encode("state1")   # padding dropped by the mask
    assert list(batch.non_tensor_batch["raw_prompt"]) == ["state0", "state1"]
    with pytest.raises(ConfigError, match="has no class named 'Nope'"):
        build_dataset(DataConfig(custom_cls={"path": str(tmp_path / "env_dataset.py"), "name": "Nope"}), [], tok)


def test_raw_line_separators_inside_a_row_do_not_split_it(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028/U+2029/U+0085 raw; only "\n" ends a JSONL row.
    rows = [row("a\u2028b"), row("c\u2029d\x85e"), row("f")]
    path = tmp_path / "u.jsonl"
    path.write_bytes(("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n").encode())
    ds = RLDataset(str(path), text_tokenizer(), config(chat_template="plain", max_bad_row_fraction=0.0))
    assert len(ds) == 3 and ds.report == {"rows": 3, "kept": 3, "malformed": 0, "filtered_overlong": 0,
                                          "truncated": 0}
    path.write_text(json.dumps(rows[0], ensure_ascii=False) + "\n{bad\n")
    with pytest.raises(ValueError, match=r"line 2 \(bad JSON"):
        RLDataset(str(path), text_tokenizer(), config(chat_template="plain", max_bad_row_fraction=0.0))


class _Watched:
    """A tokenizer that records the longest text it was handed."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, texts, **kw):
        self.longest = max([self.longest] + [len(t) for t in texts])
        return self.tok(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_huge_row_is_judged_by_characters_before_tokenising(tmp_path):
    import time
    huge = "1+" * 10_000_000                                      # 20 MB prompt
    path = write_jsonl(tmp_path / "h.jsonl", [row(huge), row("abc")])
    for kw, kept, counted in ((dict(filter_overlong_prompts=True), 1, "filtered_overlong"),
                              (dict(filter_overlong_prompts=False, truncation="left"), 2, "truncated")):
        tok = _Watched(text_tokenizer())
        start = time.perf_counter()
        ds = RLDataset(path, tok, config(chat_template="plain", max_prompt_length=8, **kw))
        assert time.perf_counter() - start < 5 and tok.longest < 10_000
        assert len(ds) == kept and ds.report[counted] == 1
    assert tok.decode(ds[0]["prompt_token_ids"]) == "1+1+1+1+"
    with pytest.raises(ValueError, match=r"h.jsonl line 1: prompt has over 1024 characters, over "
                                         r"data.max_prompt_length=8 tokens"):
        RLDataset(path, _Watched(text_tokenizer()), config(chat_template="plain", max_prompt_length=8,
                                                           filter_overlong_prompts=False))
