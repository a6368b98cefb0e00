"""Reward managers in this process: custom functions by path, signatures, failures, shaping."""
import sys
import time

import pytest
import torch

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.reward.loading import RewardFnSpec
from megarl.reward.settings import RewardSettings
from megarl.reward.manager import RewardFailure, RewardManager, build_reward_manager
from megarl.reward.scorers import InProcessScorer
from tests.helpers.reward import rollout_batch, text_tokenizer, tokenizer

CUSTOM = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if ground_truth == "raise":
        raise ValueError("cannot parse " + solution_str)
    if ground_truth == "hang":
        while True:
            time.sleep(0.05)
    return {"score": float(solution_str.strip() == ground_truth) + bonus, "acc": solution_str.strip() == ground_truth,
            "index": extra_info["index"]}

def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    return [scale * len(s) for s in solution_strs]

def bad_signature(solution, truth):
    return 1.0
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_default_rules_token_placement_and_info():
    batch = rollout_batch(["12", "13", "7", ""], ["12", "12", "7", "3"])
    result = build_reward_manager(cfg(), tokenizer())(batch)
    scores = result.token_level_scores
    # each score sits on the last counted token: "12<eos>" -> position 2, "" + eos -> position 0
    assert scores[0].tolist()[:4] == [0, 0, 1, 0] and scores[1].sum() == 0 and scores[2, 1] == 1
    assert scores.sum().item() == 2.0
    assert result.extra_info["acc"] == [1.0, 0.0, 1.0, 0.0] and result.extra_info["pred"][1] == "13"
    result.apply(batch)
    assert "token_level_scores" in batch.batch and list(batch.non_tensor_batch["acc"]) == [1.0, 0.0, 1.0, 0.0]


def test_custom_function_by_file_and_kwargs(reward_file):
    c = cfg(f"custom_reward_function.path={reward_file}", "custom_reward_function.reward_kwargs={bonus: 0.5}")
    res = build_reward_manager(c, tokenizer())(rollout_batch(["5", "6"], ["5", "5"], source="anything"))
    assert res.token_level_scores.sum(-1).tolist() == [1.5, 0.5]
    assert res.extra_info["index"] == [0, 1]


def test_custom_function_by_module(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    c = cfg("custom_reward_function.path=myrewards.scoring", "custom_reward_function.name=compute_score")
    res = build_reward_manager(c, tokenizer())(rollout_batch(["5"], ["5"], source="x"))
    assert res.token_level_scores.sum().item() == 1.0
    sys.modules.pop("myrewards.scoring", None)


@pytest.mark.parametrize("overrides, words", [
    (["custom_reward_function.name=bad_signature"],
     "bad_signature(solution, truth) cannot be called as (data_source, solution_str"),
    (["custom_reward_function.name=nope"],
     "has no function named 'nope'; it defines: bad_signature, batch_score, compute_score"),
    (["custom_reward_function.reward_kwargs={temperature: 2}"], "unexpected keyword argument 'temperature'"),
    (["reward_model.reward_manager=batch", "custom_reward_function.name=compute_score"],
     "cannot be called as (data_sources"),
])
def test_bad_functions_are_refused_up_front(reward_file, overrides, words):
    with pytest.raises(ConfigError) as info:
        build_reward_manager(cfg(f"custom_reward_function.path={reward_file}", *overrides), tokenizer())
    assert words in str(info.value) and "\n" not in str(info.value)
    assert info.value.key.startswith("custom_reward_function")


def test_missing_file_and_module():
    with pytest.raises(ConfigError, match="file not found"):
        build_reward_manager(cfg("custom_reward_function.path=/nowhere/r.py"), tokenizer())
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg.rewards'"):
        build_reward_manager(cfg("custom_reward_function.path=no_such_pkg.rewards"), tokenizer())


def test_in_process_failures_and_timeout_are_counted(reward_file):
    c = cfg(f"custom_reward_function.path={reward_file}", "reward_model.timeout_s=0.5",
            "reward_model.failure_score=-1.0", "reward_model.max_failure_fraction=0.5")
    manager = build_reward_manager(c, tokenizer())
    t = time.perf_counter()
    res = manager(rollout_batch(["5", "5", "5", "5"], ["5", "raise", "hang", "4"], source="x"))
    assert time.perf_counter() - t < 5
    assert res.token_level_scores.sum(-1).tolist() == [1.0, -1.0, -1.0, 0.0]
    assert res.metrics["reward/failures"] == 1 and res.metrics["reward/timeouts"] == 1
    assert res.extra_info["reward_failed"] == [False, True, True, False]
    # the run goes on: the next batch scores normally
    assert manager(rollout_batch(["5"], ["5"], source="x")).token_level_scores.sum() == 1.0
    assert manager.totals == {"failures": 1, "timeouts": 1}


def test_too_many_failures_stop_with_one_line(reward_file):
    c = cfg(f"custom_reward_function.path={reward_file}", "reward_model.max_failure_fraction=0.25")
    with pytest.raises(RewardFailure) as info:
        build_reward_manager(c, tokenizer())(rollout_batch(["5", "5", "5"], ["raise", "raise", "5"], source="x"))
    msg = str(info.value)
    assert "failed on 2 of 3 samples" in msg and "ValueError: cannot parse 5" in msg and "\n" not in msg


def test_batch_manager(reward_file):
    c = cfg(f"custom_reward_function.path={reward_file}", "custom_reward_function.name=batch_score",
            "reward_model.reward_manager=batch", "custom_reward_function.reward_kwargs={scale: 2.0}")
    res = build_reward_manager(c, tokenizer())(rollout_batch(["5", "678"], ["", ""], source="x"))
    assert res.token_level_scores.sum(-1).tolist() == [2.0, 6.0]


SEED_001_MANAGER = '''
import torch

class CustomRewardManager:
    def __init__(self, environment, **kwargs):
        self.env = environment
        self.seen = kwargs

    def __call__(self, data):
        rewards = []
        for i in range(len(data.batch)):
            response = data.batch["responses"][i]
            rewards.append(float(response[0].item() == self.env))
        return torch.tensor(rewards, dtype=torch.float32)

class TokenLevel:
    def __call__(self, data):
        return {"reward_tensor": data.batch["response_mask"].float() * 0.5,
                "reward_extra_info": {"text": list(data.non_tensor_batch["response_text"])}}
'''


def test_custom_manager_class_as_in_seed_001(tmp_path):
    path = tmp_path / "managers.py"
    path.write_text(SEED_001_MANAGER)
    first_digit_5 = tokenizer().convert_tokens_to_ids("5")
    c = cfg(f"reward_model.reward_manager={path}:CustomRewardManager",
            f"reward_model.reward_manager_kwargs={{environment: {first_digit_5}}}")
    manager = build_reward_manager(c, tokenizer())
    assert "tokenizer" in manager.scorer.instance.seen                 # **kwargs receive what we have
    res = manager.result(manager.compute_async(rollout_batch(["51", "6"], ["", ""])))
    assert res.token_level_scores[0, 2] == 1.0 and res.token_level_scores[1].sum() == 0.0
    token = build_reward_manager(cfg(f"reward_model.reward_manager={path}:TokenLevel"), tokenizer())
    res = token(rollout_batch(["51", "6"], ["", ""]))
    assert res.token_level_scores.sum(-1).tolist() == [1.5, 1.0] and res.extra_info["text"] == ["51", "6"]
    with pytest.raises(ConfigError, match="reward_manager_kwargs"):
        build_reward_manager(cfg(f"reward_model.reward_manager={path}:CustomRewardManager"), tokenizer())
    with pytest.raises(ConfigError, match="'pkg.module:Class'"):
        build_reward_manager(cfg("reward_model.reward_manager=prime"), tokenizer())


def test_reward_model_scores_plug_in():
    batch = rollout_batch(["1", "22"], ["", ""])
    batch.batch["rm_scores"] = torch.tensor([0.3, -0.2])
    res = build_reward_manager(cfg(), tokenizer())(batch)
    assert (res.token_level_scores[0, 1].item() == pytest.approx(0.3)
            and res.token_level_scores[1, 2].item() == pytest.approx(-0.2))


def test_format_bonus_and_overlong_penalty():
    c = cfg("reward_model.format_reward=think", "reward_model.format_score=0.25")
    manager = build_reward_manager(c, text_tokenizer())
    texts = ["<think>2+2</think>\\boxed{4}", "\\boxed{4}", "<think>x</think>\\boxed{5}"]
    res = manager(rollout_batch(texts, ["4", "4", "4"], source="math", width=32, tok=text_tokenizer()))
    # "math" scores as verl's math_dapo does: -1 for a wrong answer, so the third gets -1 + 0.25
    assert res.token_level_scores.sum(-1).tolist() == [1.25, 1.0, -0.75]
    assert res.extra_info["format"] == [1.0, 0.0, 1.0] and res.metrics["reward/format_ok"] == pytest.approx(2 / 3)
    over = load_config(None, ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4",
                              "data.max_response_length=8"])
    manager = RewardManager(tokenizer(), InProcessScorer(tokenizer(), RewardFnSpec()), RewardSettings.of(over))
    res = manager(rollout_batch(["1", "123456"], ["1", "0"], width=8))
    # lengths 2 and 7 (with EOS): expected 8 - 4 = 4; 7 exceeds by 3 -> -3/4
    assert res.token_level_scores.sum(-1).tolist() == pytest.approx([1.0, -0.75])
    assert res.metrics["reward/overlong_ratio"] == 0.5


def test_unknown_data_source_and_missing_ground_truth():
    with pytest.raises(ValueError, match="no built-in reward rule for data source"):
        build_reward_manager(cfg(), tokenizer())(rollout_batch(["1"], ["1"], source="my_set"))
    batch = rollout_batch(["1"], ["1"])
    del batch.non_tensor_batch["reward_model"]
    with pytest.raises(ValueError, match="ground_truth"):
        build_reward_manager(cfg(), tokenizer())(batch)
