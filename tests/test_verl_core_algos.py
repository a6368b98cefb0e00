"""Every policy loss, advantage estimator and KL estimator megarl registers, against verl 0.9.1's own
function in verl.trainer.ppo.core_algos, on random tensors with padded masks, several seeds, every
loss_agg_mode both accept, and the metrics both report.

    pip install --no-deps verl==0.9.1 && pip install -e '.[test]'   (omegaconf, orjson: verl imports them)
    python -m pytest -q tests/test_verl_core_algos.py

The names come from megarl's registries, so a name registered without an entry in ORACLE (verl's function
for it) or MEGARL_ONLY (why there is none) fails test_every_registered_name_has_an_oracle.
"""
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import types

import numpy as np
import pytest
import torch

from megarl.algos.advantages import ADV_ESTIMATORS
from megarl.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from megarl.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES, Aggregator, ClipParams, value_loss
from megarl.config import ConfigError
from megarl.experiment import load_config

REASON = "the oracle is verl 0.9.1's core_algos: pip install --no-deps verl==0.9.1 (and megarl's [test] extras)"
if importlib.machinery.PathFinder.find_spec("verl") is None:    # sys.path only, never a stand-in module
    pytest.skip(REASON, allow_module_level=True)


class _NotInstalled:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("tensordict / codetiming are not installed; no function compared here uses them")


def _absent(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    module.__getattr__ = lambda attr: _NotInstalled if not attr.startswith("__") else None  # type: ignore
    return module


def _core_algos():
    """verl.trainer.ppo.core_algos without verl/__init__.py (which needs ray and tensordict, not installed
    with --no-deps). verl.utils imports tensordict's TensorDict and codetiming's Timer at module level for
    its batch and timing helpers; the loss, advantage and KL functions never call them, so those two
    stand in as names that raise when used, and only while the import runs."""
    root = os.path.dirname(importlib.machinery.PathFinder.find_spec("verl").origin)
    # another oracle test may have left verl.utils as a bare package (its __init__ not run); ours needs it run
    if "verl.utils" in sys.modules and getattr(sys.modules["verl.utils"], "__file__", None) is None:
        del sys.modules["verl.utils"]
    if "verl" not in sys.modules or not hasattr(sys.modules["verl"], "__path__"):
        package = types.ModuleType("verl")
        package.__path__ = [root]
        sys.modules["verl"] = package
    absent = [n for n in ("tensordict", "tensordict.tensorclass", "codetiming")
              if importlib.util.find_spec(n.split(".")[0]) is None]
    sys.modules.update({n: _absent(n) for n in absent})
    try:
        import verl.trainer.ppo.core_algos as core_algos
        from verl.trainer.config import AlgoConfig
        from verl.workers.config import ActorConfig, PolicyLossConfig
    finally:
        for n in absent:
            sys.modules.pop(n, None)
    return core_algos, ActorConfig, PolicyLossConfig, AlgoConfig


ca, VerlActorConfig, VerlPolicyLossConfig, VerlAlgoConfig = _core_algos()

# megarl name -> (verl's registered name, what megarl's call adds to reach verl's case)
ORACLE = {
    "vanilla": "vanilla", "dual_clip": "vanilla", "gspo": "gspo", "cispo": "cispo", "sapo": "sapo",
    "geo_mean": "geo_mean", "clip_cov": "clip_cov", "kl_cov": "kl_cov", "gpg": "gpg", "dro": "dro",
    "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl",
    # the original PPO clip is verl's vanilla with its dual-clip bound out of reach
    "ppo_clip": "vanilla",
    # with the behaviour policy given, the decoupled losses are verl's vanilla weighted by pi_prox / pi_behav;
    # m2po masks nothing while the mean (log w)^2 is under its bound, which the inputs here keep
    "decoupled_ppo": "vanilla", "m2po": "vanilla",
}
MEGARL_ONLY: dict[str, str] = {}      # a registered loss with no verl counterpart: name -> why
VERL_LOSSES_MEGARL_REFUSES = {"bypass_mode": "megarl's algorithm.rollout_correction.bypass_mode with vanilla"}

ADV_ORACLE = {"gae": "gae", "grpo": "grpo", "drgrpo": "grpo", "dr_grpo": "grpo", "rloo": "rloo",
              "grpo_vectorized": "grpo_vectorized", "rloo_vectorized": "rloo_vectorized", "opo": "opo", "gpg": "gpg",
              "grpo_passk": "grpo_passk", "reinforce_plus_plus": "reinforce_plus_plus",
              "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "remax": "remax"}
# verl's estimators megarl does not implement: refused when the config loads (test_verl_only_names_are_refused)
VERL_ESTIMATORS_MEGARL_REFUSES = {
    "gdpo": "per-reward-key group normalisation over several reward fields megarl's reward does not return",
    "optimal_token_baseline": "needs the sum of squared policy probabilities (calculate_sum_pi_squared)",
    "tir_optimal_token_baseline": "the same, over multi-turn tool rounds",
}
KL_NAMES_VERL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

SEEDS = (0, 1, 2)
RTOL, ATOL = 1e-5, 1e-6
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
VARIANT_KEYS = {"clip_cov_ratio": 0.2, "clip_cov_lb": -2.0, "clip_cov_ub": 2.0, "kl_cov_ratio": 0.2,
                "ppo_kl_coef": 0.3, "dro_beta": 0.15}
TAUS = {"tau_pos": 1.5, "tau_neg": 2.5}


def verl_agg_modes() -> list[str]:
    """The modes verl's ActorConfig accepts, read from its own validation list."""
    source = inspect.getsource(VerlActorConfig.__post_init__)
    block = re.search(r"valid_loss_agg_modes = \[(.*?)\]", source, re.S).group(1)
    return re.findall(r'"([^"]+)"', block)


def inputs(seed: int, B: int = 7, R: int = 11):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, R + 1, (B,), generator=g)
    lens[0] = R                                                   # one row fills the width
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    mask[1, 0] = 0.0 if lens[1] > 1 else 1.0                      # a hole inside a response (tool output)
    old = -torch.rand(B, R, generator=g) * 3 - 0.05               # log-probs of probabilities < 1
    new = (old + 0.35 * torch.randn(B, R, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, R).clone()     # one score per response, as outcome rewards
    adv[2] += 0.5 * torch.randn(R, generator=g)                   # and one with token-level advantages
    weights = torch.rand(B, R, generator=g) * 1.5 + 0.25
    return old, new, adv, mask, weights


def verl_actor(mode: str, agg: str, clip_c: float = CLIP_C):
    config = VerlActorConfig(strategy="megatron", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                             clip_ratio=0.2, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=clip_c,
                             loss_agg_mode=agg, policy_loss=VerlPolicyLossConfig(loss_mode=mode, **VARIANT_KEYS),
                             **TAUS)
    return config


def megarl_params(name: str) -> ClipParams:
    return ClipParams(CLIP_LOW, CLIP_HIGH, None if name == "ppo_clip" else CLIP_C, **TAUS, **VARIANT_KEYS)


def run_both(name: str, agg: str, seed: int, with_weights: bool):
    old, new, adv, mask, weights = inputs(seed)
    extra, verl_weights, megarl_weights = {}, (weights if with_weights else None), (weights if with_weights else None)
    if name in ("decoupled_ppo", "m2po"):
        # their weight is pi_prox / pi_behav itself (megarl refuses rollout_is beside them, loss_fn.py)
        behav = old - (0.1 if name == "m2po" else 0.6) * (weights - 1.0)      # m2po: mean (log w)^2 under 0.04
        extra, megarl_weights = {"behav_log_prob": behav}, None
        verl_weights = (old - behav).exp()
    verl_fn = ca.get_policy_loss_fn(ORACLE[name])
    torch.manual_seed(seed)                     # clip_cov draws its tokens from torch's generator
    theirs, their_metrics = verl_fn(old, new.clone(), adv, mask, agg,
                                    verl_actor(ORACLE[name], agg, 1e9 if name == "ppo_clip" else CLIP_C),
                                    rollout_is_weights=verl_weights)
    torch.manual_seed(seed)
    ours, our_metrics = POLICY_LOSSES.get(name)(old, new.clone(), adv, mask, megarl_params(name), Aggregator(agg),
                                                is_weights=megarl_weights, **extra)
    return float(theirs), float(ours), their_metrics, our_metrics


DIFFS: dict[str, float] = {}


def test_every_registered_name_has_an_oracle():
    assert set(POLICY_LOSSES.names()) == set(ORACLE) | set(MEGARL_ONLY), "a policy loss without its verl oracle"
    assert set(ADV_ESTIMATORS.names()) == set(ADV_ORACLE), "an advantage estimator without its verl oracle"
    assert set(KL_ESTIMATORS.names()) == set(KL_NAMES_VERL), "a KL estimator without its verl oracle"
    # and the other way round: every loss verl registers is megarl's, or refused with megarl's way
    assert set(ca.POLICY_LOSS_REGISTRY) == set(ORACLE.values()) | set(VERL_LOSSES_MEGARL_REFUSES)
    assert set(ca.ADV_ESTIMATOR_REGISTRY) == set(ADV_ORACLE.values()) | set(VERL_ESTIMATORS_MEGARL_REFUSES)


@pytest.mark.parametrize("key, name", [("algorithm.adv_estimator", n) for n in VERL_ESTIMATORS_MEGARL_REFUSES]
                         + [("actor_rollout_ref.actor.policy_loss.loss_mode", n) for n in VERL_LOSSES_MEGARL_REFUSES])
def test_verl_only_names_are_refused(key, name):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={name}", "actor_rollout_ref.rollout.n=2"])
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_loss_agg_modes_are_verls():
    assert sorted(LOSS_AGG_MODES) == sorted(verl_agg_modes())


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(ORACLE))
def test_policy_loss_matches_verl(name, agg):
    for seed in SEEDS:
        for with_weights in (False, True):
            theirs, ours, their_metrics, our_metrics = run_both(name, agg, seed, with_weights)
            assert ours == pytest.approx(theirs, rel=RTOL, abs=ATOL), (name, agg, seed, with_weights)
            DIFFS[f"{name}/{agg}"] = max(DIFFS.get(f"{name}/{agg}", 0.0), abs(ours - theirs))
            for key, value in their_metrics.items():
                assert key in our_metrics, f"{name}: verl reports {key}, megarl does not"
                assert float(our_metrics[key]) == pytest.approx(float(value), rel=RTOL, abs=ATOL), (name, key)


def test_aggregation_matches_verls_with_the_trainers_counts():
    """verl's trainer passes agg_loss the mini-batch's counts (global_batch_size: every sequence, an empty
    one included; batch_num_tokens; loss_scale_factor); megarl's Aggregator gets the same from its worker.
    Without counts, verl's agg_loss leaves an empty sequence out of a seq-mean while megarl counts it, as
    verl's trainer does: megarl always aggregates with the trainer's counts (docs/verl.md, Algorithms)."""
    _, new, _, mask, _ = inputs(5)
    mask[3] = 0.0                                                   # a response with no token to train
    for mode in LOSS_AGG_MODES:
        for tokens, seqs, norm in ((float(mask.sum()), 7, 11), (40.0, 12, 16)):
            theirs = ca.agg_loss(new, mask, mode, dp_size=1, batch_num_tokens=tokens, global_batch_size=seqs,
                                 loss_scale_factor=norm)
            ours = Aggregator(mode, tokens, seqs, norm)(new, mask)
            assert float(ours) == pytest.approx(float(theirs), rel=RTOL, abs=ATOL), (mode, tokens, seqs)


def test_losses_see_the_tokens_they_should():
    """The inputs reach the branches: clipping on both sides, dual clip, clip_cov's and kl_cov's picks."""
    old, new, adv, mask, _ = inputs(0)
    ratio = (new - old).exp()[mask > 0]
    assert (ratio > 1 + CLIP_HIGH).any() and (ratio < 1 - CLIP_LOW).any()
    for name in ("clip_cov", "kl_cov", "vanilla", "geo_mean"):
        _, _, _, metrics = run_both(name, "token-mean", 0, False)
        assert any(float(v) > 0 for k, v in metrics.items() if "clipfrac" in k) or name == "kl_cov", name


def test_policy_gradients_match_verl():
    """The gradient, not only the value: stop-gradients (cispo, gspo, sapo's gate) are where they are in verl."""
    for name in sorted(ORACLE):
        old, new, adv, mask, _ = inputs(4)
        extra = {"behav_log_prob": old} if name in ("decoupled_ppo", "m2po") else {}
        theirs_in, ours_in = new.clone().requires_grad_(), new.clone().requires_grad_()
        torch.manual_seed(4)
        ca.get_policy_loss_fn(ORACLE[name])(old, theirs_in, adv, mask, "token-mean",
                                            verl_actor(ORACLE[name], "token-mean",
                                                       1e9 if name == "ppo_clip" else CLIP_C))[0].backward()
        torch.manual_seed(4)
        POLICY_LOSSES.get(name)(old, ours_in, adv, mask, megarl_params(name), Aggregator("token-mean"),
                                **extra)[0].backward()
        assert torch.allclose(ours_in.grad, theirs_in.grad, rtol=RTOL, atol=ATOL), name


# -- advantage estimators ------------------------------------------------------------------------------
def adv_inputs(seed: int, B: int = 12, R: int = 7):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    scores = torch.randint(0, 3, (B,), generator=g).float() + 0.1 * torch.randn(B, generator=g)
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), lens - 1] = scores                   # outcome reward on the last token
    rewards += 0.05 * torch.randn(B, R, generator=g) * mask       # and a little per token (e.g. a KL penalty)
    uid = np.array([f"p{i // 4}" for i in range(B - 1)] + ["lone"], dtype=object)   # groups of 4, one of 1
    values = torch.randn(B, R, generator=g)
    baselines = torch.randn(B, generator=g)
    return rewards, mask, uid, values, baselines


def verl_adv(name: str, rewards, mask, uid, values, baselines, gamma, lam, norm):
    fn = ca.get_adv_estimator_fn(ADV_ORACLE[name])
    config = VerlAlgoConfig(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm)
    if name == "gae":
        return fn(token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)
    if name == "remax":
        return fn(token_level_rewards=rewards, reward_baselines=baselines, response_mask=mask, config=config)
    if name == "reinforce_plus_plus":
        return fn(token_level_rewards=rewards, response_mask=mask, config=config)
    if name in ("drgrpo", "dr_grpo"):
        norm = False
    kwargs = {"norm_adv_by_std_in_grpo": norm} if name in ("grpo", "grpo_vectorized", "drgrpo", "dr_grpo") else {}
    return fn(token_level_rewards=rewards.clone(), response_mask=mask, index=uid, config=config, **kwargs)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name", sorted(ADV_ORACLE))
def test_advantage_estimator_matches_verl(name, norm):
    for seed in SEEDS:
        rewards, mask, uid, values, baselines = adv_inputs(seed)
        if name == "grpo_passk":
            uid = np.array([f"p{i // 4}" for i in range(len(uid))], dtype=object)   # needs >= 2 per group
        gamma, lam = (0.97, 0.9) if seed else (1.0, 1.0)
        theirs = verl_adv(name, rewards, mask, uid, values, baselines, gamma, lam, norm)
        ours = ADV_ESTIMATORS.get(name)(token_level_rewards=rewards.clone(), response_mask=mask, uid=uid,
                                        values=values, reward_baselines=baselines, gamma=gamma, lam=lam,
                                        norm_adv_by_std_in_grpo=norm)
        on = mask > 0
        for what, t, o in zip(("advantages", "returns"), theirs, ours):
            # compared on response tokens: what a padded position holds reaches no loss
            assert torch.allclose(o[on], t[on], rtol=RTOL, atol=1e-5), (name, norm, seed, what)
            DIFFS[f"adv:{name}"] = max(DIFFS.get(f"adv:{name}", 0.0), float((o[on] - t[on]).abs().max()))


# -- KL estimators -------------------------------------------------------------------------------------
@pytest.mark.parametrize("plus", ["", "+"])
@pytest.mark.parametrize("name", sorted(KL_NAMES_VERL))
def test_kl_estimator_matches_verl(name, plus):
    old, new, _, _, _ = inputs(3)
    new = torch.cat([new, old + 25.0], dim=0)          # and a wild token: the clamps are verl's
    old = torch.cat([old, old], dim=0)
    theirs_in, ours_in = new.clone().requires_grad_(), new.clone().requires_grad_()
    theirs = ca.kl_penalty(theirs_in, old, name + plus)
    ours = kl_penalty(ours_in, old, name + plus)
    assert torch.allclose(ours, theirs, rtol=RTOL, atol=ATOL), name + plus
    theirs.sum().backward()
    ours.sum().backward()
    assert torch.allclose(ours_in.grad, theirs_in.grad, rtol=RTOL, atol=ATOL), name + plus
    DIFFS[f"kl:{name}{plus}"] = float((ours - theirs).detach().abs().max())


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_value_loss_matches_verl(agg):
    for seed in SEEDS:
        old, new, _, mask, weights = inputs(seed)
        returns = old + weights - 1.0
        theirs, their_clipfrac = ca.compute_value_loss(new, returns, old, mask, cliprange_value=0.2, loss_agg_mode=agg)
        ours, metrics = value_loss(new, returns, old, mask, 0.2, Aggregator(agg))
        assert float(ours) == pytest.approx(float(theirs), rel=RTOL, abs=ATOL), (agg, seed)
        assert float(metrics["critic/vf_clipfrac"]) == pytest.approx(float(their_clipfrac), abs=ATOL)
        DIFFS[f"value_loss/{agg}"] = max(DIFFS.get(f"value_loss/{agg}", 0.0), abs(float(ours) - float(theirs)))


def test_kl_controllers_match_verl():
    theirs, ours = ca.AdaptiveKLController(0.05, 0.1, 500), AdaptiveKLController(0.05, 0.1, 500)
    fixed_theirs, fixed_ours = ca.FixedKLController(0.02), FixedKLController(0.02)
    for kl, n in ((0.3, 64), (0.01, 64), (0.11, 32), (0.0, 128), (0.5, 7)):
        for a, b in ((theirs, ours), (fixed_theirs, fixed_ours)):
            a.update(current_kl=kl, n_steps=n)
            b.update(current_kl=kl, n_steps=n)
            assert b.value == pytest.approx(a.value, rel=1e-12)


def test_report_the_largest_difference():
    """Runs last in this file: prints how many (name, mode) pairs were compared and the largest gap."""
    if DIFFS:
        worst = max(DIFFS.items(), key=lambda kv: kv[1])
        print(f"\nverl oracle: {len(DIFFS)} (name, mode) pairs, largest |megarl - verl| {worst[1]:.3g} ({worst[0]})")
