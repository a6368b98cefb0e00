"""The quickstart's task: shipped data, tokenizer, Qwen2 model and the bootstrap checkpoint."""
import json
import os

import pytest
import torch

from megarl.experiment import load_config
from megarl.data.dataset import RLDataset
from megarl.examples.addition.model import build_model, build_tokenizer
from megarl.examples.addition.task import AdditionTask, split_problems, write_dataset
from megarl.reward.rules import default_compute_score


def test_shipped_data_is_the_generators_and_val_is_held_out(tmp_path):
    train_path, val_path = write_dataset(str(tmp_path))
    for name, path in (("train", train_path), ("val", val_path)):
        assert open(path).read() == open(f"data/addition/{name}.jsonl").read(), \
            "regenerate: python -m megarl.examples.addition.task"
    val = [json.loads(line) for line in open(val_path)]
    train = [json.loads(line) for line in open(train_path)]
    assert len(val) == 512 and len(train) == 3000

    def key(r):
        return r["prompt"][0]["content"]

    assert not {key(r) for r in val} & {key(r) for r in train}
    r = val[0]
    a, b = map(int, key(r)[:-1].split("+"))
    assert r["reward_model"]["ground_truth"] == str(a + b) and r["data_source"] == "addition"
    # warm-start problems never include a validation problem
    task = AdditionTask()
    held = set(split_problems(task, 0, 512)[1])
    stream = task.problems(123, exclude=held)
    assert not any(next(stream) in held for _ in range(2000))


def test_tokenizer_round_trip_and_template():
    tok = build_tokenizer()
    ids = tok.encode("123+45=168")
    assert len(ids) == 10 and tok.decode(ids) == "123+45=168"
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "123+45=168"
    assert tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
                                   add_generation_prompt=True) == "1+2="
    assert len(tok) == 16 and tok.pad_token_id != tok.eos_token_id


def test_quickstart_data_loads_through_the_dataset_path():
    cfg = load_config("configs/quickstart.yaml")
    ds = RLDataset(cfg.data.val_files, build_tokenizer(), cfg.data, split="val")
    assert len(ds) == 512 and ds.report["malformed"] == 0 and ds.report["filtered_overlong"] == 0
    item = ds[0]
    assert build_tokenizer().decode(item["prompt_token_ids"]) == item["raw_prompt"][0]["content"]
    truth = item["reward_model"]["ground_truth"]
    assert default_compute_score(item["data_source"], truth, truth)["score"] == 1.0
    assert cfg.model.bootstrap == "megarl.examples.addition:bootstrap"


def test_model_shape_allows_tp2():
    model = build_model(build_tokenizer())
    c = model.config
    assert c.num_attention_heads % 2 == 0 and c.num_key_value_heads % 2 == 0 and c.num_hidden_layers % 2 == 0
    assert 2e5 < sum(p.numel() for p in model.parameters()) < 2e6


@pytest.mark.timeout(300)
def test_bootstrap_writes_a_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.examples.addition import bootstrap
    out = str(tmp_path / "model")
    assert bootstrap(out, None, warm_start_steps=3, eval_rows=8, verbose=False) == out
    assert {"config.json", "model.safetensors", "tokenizer.json", "warmstart.json"} <= set(os.listdir(out))
    stats = json.load(open(os.path.join(out, "warmstart.json")))
    assert stats["steps"] == 3 and 0 <= stats["val_accuracy_greedy"] <= 1
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.encode("7+8=")
    assert tok.decode(ids) == "7+8=" and tok.eos_token == "<eos>"
    fresh = build_model(build_tokenizer())
    with torch.no_grad():                               # the saved weights are the trained ones
        assert not torch.equal(model.model.embed_tokens.weight, fresh.model.embed_tokens.weight)
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 4, len(tok))
    mtime = os.path.getmtime(os.path.join(out, "model.safetensors"))
    bootstrap(out, warm_start_steps=3, verbose=False)     # exists: left alone
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == mtime
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".bootstrap-")]
