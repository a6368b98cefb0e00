"""ReMax end to end (algorithm.adv_estimator=remax): 2 gloo ranks, megatron TP=2, the native engine.

Each step generates one greedy response per prompt beside the n sampled ones and scores it with
the same reward (a manager that records its calls: tests/assets/recording_reward.py); its score
is the baseline of the prompt's samples, and the step's advantages are verl's
compute_remax_outcome_advantage of those rewards and baselines. The train and validation files
hold the same 8 prompts, so step 0's greedy validation shows what the greedy baseline must be.
"""
import json
from typing import Optional

import pytest
import torch

from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, overrides, train
from tests.helpers.verl_source import verl_function


def _rows(path, n):
    return [json.loads(line) for line in open(path)][:n]


def _placed(scores, mask):
    """[B] scores on each row's last response token, as megarl and verl's reward loop place them."""
    out = torch.zeros(mask.shape)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    out[torch.arange(mask.shape[0]), last] = torch.tensor(scores)
    return out


@pytest.mark.timeout(700)
def test_remax_scores_a_greedy_baseline_and_matches_verls_advantages(addition_model_dir, tmp_path):
    compute_remax_outcome_advantage = verl_function("trainer/ppo/core_algos.py", "compute_remax_outcome_advantage",
                                                    namespace={"torch": torch, "Optional": Optional,
                                                               "AlgoConfig": object})
    data = tmp_path / "eight.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows("data/addition/train.jsonl", 8)))
    log = tmp_path / "calls.jsonl"
    run = tmp_path / "remax"
    code, out = finish(train(overrides(
        addition_model_dir, run, "algorithm.adv_estimator=remax", "trainer.total_training_steps=2",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=true",
        f"data.train_files={data}", f"data.val_files={data}",
        "reward_model.reward_manager=tests/assets/recording_reward.py:RecordingReward",
        f"reward_model.reward_manager_kwargs.log_path={log}")))
    assert code == 0, out[-4000:]
    calls = [json.loads(line) for line in open(log)]
    metrics = {r["step"]: r for r in read_metrics(str(run))}
    assert sorted(metrics) == [0, 1, 2]
    val, steps = calls[0], calls[1:]
    assert all(u.startswith("val-") for u in val["uid"]) and len(val["uid"]) == 8
    # per step: one greedy response per prompt (scored with the rollout), then the n=4 samples of the
    # 8 prompts (scored beside the log-prob passes)
    assert [len(c["uid"]) for c in steps] == [8, 32, 8, 32]
    greedy_of = dict(zip(val["prompt"], val["response"]))     # step 0's weights are step 1's rollout weights
    for step, (base, sampled) in zip((1, 2), (steps[0:2], steps[2:4])):
        assert sorted(base["uid"]) == sorted(set(sampled["uid"]))
        if step == 1:
            assert [greedy_of[p] for p in base["prompt"]] == base["response"]
        baseline = dict(zip(base["uid"], base["score"]))
        mask = torch.tensor(sampled["response_mask"], dtype=torch.float32)
        adv, ret = compute_remax_outcome_advantage(
            token_level_rewards=_placed(sampled["score"], mask), response_mask=mask,
            reward_baselines=torch.tensor([baseline[u] for u in sampled["uid"]]))
        valid = mask > 0
        m = metrics[step]
        assert m["critic/score/mean"] == pytest.approx(sum(sampled["score"]) / 32)
        for name, t in (("critic/advantages", adv[valid]), ("critic/returns", ret[valid])):
            assert m[f"{name}/mean"] == pytest.approx(t.mean().item(), abs=1e-5), name
            assert m[f"{name}/max"] == pytest.approx(t.max().item(), abs=1e-5), name
            assert m[f"{name}/min"] == pytest.approx(t.min().item(), abs=1e-5), name
        assert adv[valid].abs().max() > 0        # the baseline differs from some samples' scores


def test_remax_is_refused_by_the_disaggregated_loop_at_config_time():
    from megarl.config import ConfigError
    from megarl.experiment import load_config
    from megarl.trainer.loop.baselines import takes_baselines
    disaggregated = ["actor_rollout_ref.rollout.placement=disaggregated", "trainer.n_gpus_per_node=3",
                     "actor_rollout_ref.rollout.disaggregated_ranks=1"]
    load_config(None, [*disaggregated, "algorithm.adv_estimator=reinforce_plus_plus"])
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator: remax is not supported with "
                                          r"rollout.placement=disaggregated .*use placement=colocated"):
        load_config(None, [*disaggregated, "algorithm.adv_estimator=remax"])
    # the loop asks the estimator (its signature) whether it takes baselines
    assert takes_baselines("remax") and not takes_baselines("grpo") and not takes_baselines("gae")
