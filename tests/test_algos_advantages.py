"""Advantage estimators against hand-computed numbers (megarl/algos/advantages.py)."""
import math

import numpy as np
import pytest
import torch

from megarl.algos.advantages import ADV_ESTIMATORS, compute_advantage, get_adv_estimator
from megarl.algos.config import CRITIC_ESTIMATORS, GROUP_ESTIMATORS, AlgorithmConfig
from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.protocol import DataProto


def outcome(scores, lengths, width=4):
    """Token-level rewards with each score on the last response token, and the response mask."""
    B = len(scores)
    rewards, mask = torch.zeros(B, width), torch.zeros(B, width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


UID = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
LENS = [2, 4, 1, 3, 3, 2]


def per_row(adv, mask):
    """The single value each row carries, checking it is constant on the mask and 0 off it."""
    out = []
    for a, m in zip(adv, mask):
        vals = a[m > 0]
        assert torch.allclose(vals, vals[0].expand_as(vals)), a
        assert torch.all(a[m == 0] == 0)
        out.append(vals[0].item())
    return out


def test_grpo_hand_computed():
    r, m = outcome(SCORES, LENS)
    adv, ret = get_adv_estimator("grpo")(r, m, uid=UID)
    # group a = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); group b has no spread; c is alone (mean 0, std 1).
    s = math.sqrt(1 / 3)
    assert per_row(adv, m) == pytest.approx([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.5], abs=1e-5)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("name, kw", [("drgrpo", {}), ("dr_grpo", {}), ("grpo", {"norm_adv_by_std_in_grpo": False})])
def test_drgrpo_centres_without_std(name, kw):
    r, m = outcome(SCORES, LENS)
    adv, _ = get_adv_estimator(name)(r, m, uid=UID, **kw)
    assert per_row(adv, m) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.5], abs=1e-6)


def test_drgrpo_ignores_a_norm_flag():
    r, m = outcome(SCORES, LENS)
    adv, _ = get_adv_estimator("drgrpo")(r, m, uid=UID, norm_adv_by_std_in_grpo=True)
    assert per_row(adv, m)[0] == pytest.approx(2 / 3)


def test_rloo_leave_one_out():
    r, m = outcome(SCORES, LENS)
    adv, _ = get_adv_estimator("rloo")(r, m, uid=UID)
    # a: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); b: 0; c alone keeps its raw 0.5.
    assert per_row(adv, m) == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.5], abs=1e-6)


def test_grpo_passk_credits_only_the_best():
    r, m = outcome([1.0, 0.5, 0.0, 0.2, 0.7], [1, 1, 1, 1, 1])
    uid = np.array(["x", "x", "x", "y", "y"], dtype=object)
    adv, _ = get_adv_estimator("grpo_passk")(r, m, uid=uid, norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0, 0.5])


def test_gae_hand_computed():
    r = torch.tensor([[0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.8, 9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    # gamma 1, lam 1: t1 delta = 1 - 0.8 = 0.2; t0 delta = 0.8 - 0.5 = 0.3, adv = 0.3 + 0.2.
    _, ret = get_adv_estimator("gae")(r, m, values=v, gamma=1.0, lam=1.0)
    assert ret[0, :2].tolist() == pytest.approx([1.0, 1.0])
    # gamma 0.9, lam 0.5: t0 delta = 0.9 * 0.8 - 0.5 = 0.22, adv = 0.22 + 0.9 * 0.5 * 0.2 = 0.31.
    adv, ret = get_adv_estimator("gae")(r, m, values=v, gamma=0.9, lam=0.5)
    assert ret[0, :2].tolist() == pytest.approx([0.81, 1.0])
    # whitened over the two valid tokens [0.31, 0.2]: +-1/sqrt(2) with the unbiased variance.
    assert adv[0].tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0], abs=1e-4)


def test_gae_carries_across_masked_tool_tokens():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 7.0, 0.6]])
    m = torch.tensor([[1.0, 0.0, 1.0]])           # the middle token is tool output
    _, ret = get_adv_estimator("gae")(r, m, values=v, gamma=1.0, lam=1.0)
    # t2 delta 0.4; t1 skipped (carries value 0.6 and advantage 0.4); t0 delta 0.6 - 0.5 = 0.1 -> 0.5.
    assert ret[0].tolist() == pytest.approx([1.0, 7.4, 1.0])


def test_gae_needs_values():
    r, m = outcome([1.0], [2])
    with pytest.raises(ValueError, match="critic values"):
        get_adv_estimator("gae")(r, m)


def test_reinforce_plus_plus():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus")(r, m, gamma=0.5)
    assert ret[0].tolist() == pytest.approx([0.25, 0.5, 1.0, 0.0])
    # whitened over [0.25, 0.5, 1]: mean 7/12, unbiased std 0.381881
    assert adv[0].tolist() == pytest.approx([-0.872872, -0.218218, 1.091089, 0.0], abs=1e-5)


def test_reinforce_plus_plus_baseline():
    r, m = outcome([1.0, 0.0, 1.0, 1.0], [1, 1, 1, 1])
    uid = np.array(["a", "a", "b", "b"], dtype=object)
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(r, m, uid=uid)
    # centred [0.5, -0.5, 0, 0], whitened with unbiased std sqrt(1/6)
    assert adv[:, 0].tolist() == pytest.approx([1.224745, -1.224745, 0.0, 0.0], abs=1e-5)


def test_remax():
    r = torch.tensor([[0.0, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator("remax")(r, m, reward_baselines=torch.tensor([0.25]))
    assert ret[0].tolist() == [1.0, 1.0, 0.0]
    assert adv[0].tolist() == [0.75, 0.75, 0.0]
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(r, m)


def test_opo_and_rloo_vectorized_hand_computed():
    r, m = outcome(SCORES, LENS)
    opo, _ = get_adv_estimator("opo")(r, m, uid=UID)
    # group a: baseline (2*1 + 4*0 + 1*0) / 7; group b: 1; c alone keeps its score
    assert per_row(opo, m) == pytest.approx([1 - 2 / 7, -2 / 7, -2 / 7, 0.0, 0.0, 0.5])
    loo, _ = get_adv_estimator("rloo_vectorized")(r, m, uid=UID)
    # as rloo, but the lone response of c gets 0
    assert per_row(loo, m) == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])


def test_gpg_hand_computed():
    r, m = outcome([1.0, 0.0, 0.0, 0.0], [2, 2, 1, 3])
    gpg, _ = get_adv_estimator("gpg")(r, m, uid=np.array(["a", "a", "b", "b"], dtype=object))
    # one non-zero score in 4 responses: alpha = 4; group a's mean 0.5, group b's 0
    assert per_row(gpg, m) == pytest.approx([2.0, -2.0, 0.0, 0.0])


def test_group_estimators_need_uid():
    r, m = outcome([1.0], [1])
    with pytest.raises(ValueError, match="uid"):
        get_adv_estimator("grpo")(r, m)


def test_registry_matches_the_config_lists():
    assert set(GROUP_ESTIMATORS) | set(CRITIC_ESTIMATORS) <= set(ADV_ESTIMATORS.names())
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        get_adv_estimator("grpoo")
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: unknown advantage estimator 'grpoo'; did you mean "
                                          "'grpo'"):
        load_config(None, ["algorithm.adv_estimator=grpoo"])


def test_compute_advantage_on_a_batch():
    r, m = outcome(SCORES, LENS)
    batch = DataProto.from_dict({"token_level_rewards": r, "response_mask": m}, {"uid": UID})
    compute_advantage(batch, AlgorithmConfig(adv_estimator="rloo"))
    assert per_row(batch.batch["advantages"], m)[:3] == pytest.approx([1.0, -0.5, -0.5])
    assert "returns" in batch.batch
