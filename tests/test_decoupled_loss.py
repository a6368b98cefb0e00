"""The decoupled PPO loss and M2PO's second-moment masking (megarl/algos/decoupled.py) on
hand-computed numbers, through the registry and through the actor's loss function.

One sequence of 4 tokens, eps 0.2, dual clip 3, token-mean:
    A         =  1     1     -1     1
    r = pi_theta / pi_prox  =  1.0   1.5   0.5    1.1
    w = pi_prox / pi_behav  =  1     2     0.5    8
    PPO term  = -1.0  -1.2   0.8  -1.1      (token 1 and 2 clipped: no gradient through r)
    x w       = -1.0  -2.4   0.4  -8.8      -> mean -2.95
    cap 5     : token 3 leaves              -> (-1 - 2.4 + 0.4) / 4 = -0.75
    (log w)^2 =  0    0.480  0.480  4.324   -> tau 0.35 removes token 3 (mean of the rest 0.32);
                                               tau 0.04 removes tokens 1-3 as well (0.24 > 0.04)
"""
import pytest
import torch

from megarl.algos.decoupled import second_moment_keep
from megarl.algos.losses import Aggregator, ClipParams, get_policy_loss
from megarl.config.errors import ConfigError

PROX = torch.zeros(1, 4)
THETA = torch.tensor([[1.0, 1.5, 0.5, 1.1]]).log()
BEHAV = -torch.tensor([[1.0, 2.0, 0.5, 8.0]]).log()
ADV = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
MASK = torch.ones(1, 4)


def _loss(name, **params):
    theta = THETA.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(PROX, theta, ADV, MASK, ClipParams(0.2, 0.2, 3.0, **params),
                                          Aggregator("token-mean"), behav_log_prob=BEHAV)
    loss.backward()
    return float(loss.detach()), theta.grad, metrics


def test_decoupled_ppo_by_hand():
    value, grad, m = _loss("decoupled_ppo")
    assert value == pytest.approx(-2.95, abs=1e-6)
    # d/dlog pi_theta of -A r w / 4 where unclipped: token 0 -> -0.25, token 3 -> -1.1 * 8 / 4
    assert torch.allclose(grad, torch.tensor([[-0.25, 0.0, 0.0, -2.2]]), atol=1e-6)
    assert float(m["actor/behav_imp_weight_mean"]) == pytest.approx((1 + 2 + 0.5 + 8) / 4)
    value, grad, m = _loss("decoupled_ppo", behav_imp_weight_cap=5.0)
    assert value == pytest.approx(-0.75, abs=1e-6) and grad[0, 3] == 0
    assert float(m["actor/behav_masked_fraction"]) == 0.25


def test_m2po_by_hand():
    log_w = PROX - BEHAV
    assert second_moment_keep(log_w, MASK, 0.35).tolist() == [[True, True, True, False]]
    assert second_moment_keep(log_w, MASK, 0.04).tolist() == [[True, False, False, False]]
    assert second_moment_keep(log_w, MASK, 2.0).all()                       # mean 1.32 already under 2
    # padding is never kept and never counts toward the moment
    assert second_moment_keep(log_w, torch.tensor([[1, 1, 1, 0]]), 0.33).tolist() == [[True, True, True, False]]
    value, grad, _ = _loss("m2po", m2_threshold=0.35)
    assert value == pytest.approx(-0.75, abs=1e-6) and grad[0, 3] == 0
    value, _, m = _loss("m2po")                                              # default tau 0.04
    assert value == pytest.approx(-1.0 / 4, abs=1e-6)
    assert float(m["actor/behav_masked_fraction"]) == 0.75


def test_decoupled_through_the_actor_loss_and_its_config_checks():
    from megarl.algos.loss_fn import make_actor_loss_fn
    from megarl.experiment import load_config
    from megarl.protocol import DataProto
    key = "actor_rollout_ref.actor.policy_loss"
    base = ["actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.clip_ratio_c=3"]
    fn = make_actor_loss_fn(load_config(None, [*base, f"{key}.loss_mode=decoupled_ppo",
                                               f"{key}.behav_imp_weight_cap=5"]))
    b = DataProto({"response_mask": MASK, "old_log_probs": PROX, "rollout_log_probs": BEHAV, "advantages": ADV,
                   "response_lens": MASK.sum(-1)})
    loss, metrics = fn({"log_probs": THETA.clone().requires_grad_(True)}, b)
    assert float(loss.detach()) == pytest.approx(-0.75, abs=1e-6)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(-0.75)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        fn({"log_probs": THETA}, DataProto({k: v for k, v in b.batch.items() if k != "rollout_log_probs"}))
    with pytest.raises(ConfigError, match="behav_imp_weight_cap.*decoupled_ppo only"):
        load_config(None, [f"{key}.behav_imp_weight_cap=5"])
    with pytest.raises(ConfigError, match="m2_threshold.*m2po only"):
        load_config(None, [f"{key}.loss_mode=decoupled_ppo", f"{key}.m2_threshold=0.1"])
    with pytest.raises(ConfigError, match="rollout_correction.rollout_is"):
        make_actor_loss_fn(load_config(None, [f"{key}.loss_mode=m2po",
                                              "algorithm.rollout_correction.rollout_is=token"]))
