"""KL estimators and controllers, DAPO shaping, rollout-correction and data metrics, by hand."""
import math

import numpy as np
import pytest
import torch

from megarl.algos.config import FilterGroupsConfig, KLControlConfig
from megarl.algos.dapo import DynamicSampler, groups_with_variance, overlong_penalty
from megarl.algos.kl import AdaptiveKLController, apply_kl_penalty, kl_penalty, make_kl_controller
from megarl.algos.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from megarl.algos.rollout_correction import rollout_is_metrics, rollout_is_weights, rollout_mismatch_metrics
from megarl.protocol import DataProto

L = math.log
LOGP = torch.tensor([L(0.5), L(0.25)])
REF = torch.tensor([L(0.25), L(0.5)])


@pytest.mark.parametrize("kind, expected", [
    ("kl", [L(2), -L(2)]), ("k1", [L(2), -L(2)]), ("abs", [L(2), L(2)]),
    ("mse", [0.5 * L(2) ** 2] * 2), ("k2", [0.5 * L(2) ** 2] * 2),
    # k3 = r - 1 - log r with r = p_ref / p: r = 0.5 -> 0.5 - 1 + ln 2; r = 2 -> 2 - 1 - ln 2
    ("low_var_kl", [0.5 - 1 + L(2), 2 - 1 - L(2)]), ("k3", [0.5 - 1 + L(2), 2 - 1 - L(2)]),
])
def test_kl_estimators(kind, expected):
    assert kl_penalty(LOGP, REF, kind).tolist() == pytest.approx(expected, abs=1e-6)


def test_plus_suffix_keeps_the_value_and_takes_the_k2_gradient():
    logp = LOGP.clone().requires_grad_()
    out = kl_penalty(logp, REF, "k3+")
    assert out.tolist() == pytest.approx(kl_penalty(LOGP, REF, "k3").tolist())
    out.sum().backward()
    assert logp.grad.tolist() == pytest.approx([L(2), -L(2)])    # d/dx (x^2 / 2) = x


def test_k3_is_clamped():
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl").item() == 10.0


def test_controllers():
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctl.update(current_kl=0.2, n_steps=10)          # error clipped to +0.2 -> x(1 + 0.2 * 10 / 100)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.05, n_steps=10)         # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(0.102 * 0.98)
    again = make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.5))
    again.load_state_dict(ctl.state_dict())
    assert again.value == ctl.value
    fixed = make_kl_controller(KLControlConfig(type="fixed", kl_coef=0.3))
    fixed.update(5.0, 10)
    assert fixed.value == 0.3


def test_kl_in_reward():
    scores = torch.tensor([[0.0, 1.0]])
    old = torch.tensor([[L(0.5), L(0.5)]])
    ref = torch.tensor([[L(0.25), L(0.5)]])
    ctl = make_kl_controller(KLControlConfig(kl_coef=0.1))
    rewards, m = apply_kl_penalty(scores, old, ref, torch.ones(1, 2), ctl, "kl")
    assert rewards[0].tolist() == pytest.approx([-0.1 * L(2), 1.0])
    assert m["actor/reward_kl_penalty"] == pytest.approx(L(2) / 2)
    assert m["actor/reward_kl_penalty_coeff"] == 0.1


def test_dynamic_sampling_keeps_groups_with_variance():
    uid = np.array(["a", "a", "b", "b", "c"], dtype=object)
    assert groups_with_variance(uid, [1, 0, 1, 1, 0]).tolist() == [True, True, False, False, True]


def reward_batch(uids, accs):
    scores = torch.zeros(len(uids), 2)
    scores[:, -1] = torch.tensor(accs, dtype=torch.float32)
    return DataProto.from_dict({"token_level_scores": scores, "token_level_rewards": scores,
                                "response_mask": torch.ones(len(uids), 2)},
                               {"uid": np.array(uids, dtype=object), "acc": np.array(accs, dtype=object)})


def test_dynamic_sampler_refills_and_trims():
    buf = DynamicSampler(prompts_wanted=2, cfg=FilterGroupsConfig(enable=True, metric="acc", max_num_gen_batches=3))
    assert not buf.add(reward_batch(["p1", "p1", "p2", "p2"], [1, 1, 1, 0]))   # only p2 varies
    assert buf.add(reward_batch(["p3", "p3", "p4", "p4"], [0, 1, 0, 1]))       # p3, p4 vary
    out = buf.take()
    assert list(out.non_tensor_batch["uid"]) == ["p2", "p2", "p3", "p3"]
    assert buf.metrics()["dapo/groups_kept"] == 3 and buf.metrics()["dapo/gen_rounds"] == 2


def test_dynamic_sampler_gives_up_with_a_clear_error():
    buf = DynamicSampler(prompts_wanted=2, cfg=FilterGroupsConfig(enable=True, metric="score", max_num_gen_batches=2))
    buf.add(reward_batch(["a", "a"], [1, 1]))
    with pytest.raises(RuntimeError, match="max_num_gen_batches"):
        buf.add(reward_batch(["b", "b"], [0, 0]))
    with pytest.raises(ValueError, match="metric='nope'"):
        DynamicSampler(1, FilterGroupsConfig(metric="nope")).add(reward_batch(["a"], [1]))


def test_overlong_penalty():
    lens = torch.tensor([10, 16, 18, 20])
    assert overlong_penalty(lens, max_response_length=20, buffer_len=4,
                            penalty_factor=1.0).tolist() == [0, 0, -0.5, -1.0]


def test_rollout_is_weights():
    old = torch.tensor([[L(0.5), L(0.4)]])
    roll = torch.tensor([[L(0.25), L(0.4)]])
    m = torch.ones(1, 2)
    assert rollout_is_weights(old, roll, m, "token", 1.5)[0].tolist() == pytest.approx([1.5, 1.0])
    assert rollout_is_weights(old, roll, m, "token", 3.0)[0].tolist() == pytest.approx([2.0, 1.0])
    assert rollout_is_weights(old, roll, m, "sequence", 1.5)[0].tolist() == pytest.approx([1.5, 1.5])
    met = rollout_is_metrics(old, roll, m, "token", 1.5)
    assert met["rollout_corr/rollout_is_max"] == pytest.approx(1.5)
    assert met["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


def test_mismatch_metrics():
    old = torch.tensor([[L(0.5), L(0.4), 0.0]])
    roll = torch.tensor([[L(0.25), L(0.4), -9.0]])
    m = torch.tensor([[1, 1, 0]])
    met = rollout_mismatch_metrics(old, roll, m)
    assert met["rollout_corr/kl"] == pytest.approx((L(0.25) - L(0.5)) / 2)
    assert met["rollout_corr/k3_kl"] == pytest.approx((2 - L(2) - 1) / 2)
    assert met["rollout_corr/max_abs_log_prob_diff"] == pytest.approx(L(2))
    assert met["rollout_corr/log_ppl_diff"] == pytest.approx(-L(2) / 2)
    assert met["rollout_corr/chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    same = rollout_mismatch_metrics(old, old, m)
    assert same["rollout_corr/kl"] == 0 and same["rollout_corr/max_abs_log_prob_diff"] == 0


def test_data_timing_and_throughput_metrics():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = DataProto.from_dict({"token_level_scores": scores, "token_level_rewards": scores - 0.1,
                                 "advantages": torch.tensor([[1.0, 1.0, 9.0], [-1.0, -1.0, -1.0]]),
                                 "returns": torch.zeros(2, 3), "response_mask": mask,
                                 "prompt_lens": torch.tensor([4, 6]), "response_lens": torch.tensor([2, 3])})
    m = compute_data_metrics(batch, max_response_length=3)
    assert m["critic/score/mean"] == 0.5 and m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0
    assert m["critic/rewards/mean"] == pytest.approx(((1 - 0.3) + (-0.3)) / 2)
    assert m["critic/advantages/max"] == 1.0             # the 9 sits on a masked position
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 5.0
    t = compute_timing_metrics(batch, {"gen": 0.5, "update_actor": 1.5, "step": 3.0})
    assert t["timing_s/gen"] == 0.5 and t["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert t["timing_per_token_ms/update_actor"] == pytest.approx(1500 / 15)
    p = compute_throughput_metrics(batch, 3.0, n_devices=2)
    assert p["perf/total_num_tokens"] == 15 and p["perf/throughput"] == pytest.approx(2.5)
