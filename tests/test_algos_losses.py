"""Policy/value losses, aggregation, and the gradient contract with the Megatron worker."""
import math

import pytest
import torch

from megarl.algos.loss_fn import make_actor_loss_fn, make_critic_loss_fn, mean_metrics
from megarl.algos.losses import Aggregator, ClipParams, agg_loss, get_policy_loss, value_loss
from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.protocol import DataProto

LOG = math.log


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(7 / 8)
    # global counts: this micro-batch is part of a mini-batch with 6 tokens / 4 sequences
    assert agg_loss(loss, mask, "token-mean", global_tokens=6).item() == pytest.approx(7 / 6)
    assert agg_loss(loss, mask, "seq-mean-token-mean", global_seqs=4).item() == pytest.approx(5.5 / 4)
    # token-sum: the plain sum; the worker's DP sum of the shares is then the mini-batch's sum
    assert agg_loss(loss, mask, "token-sum", global_tokens=6, global_seqs=4).item() == pytest.approx(7.0)
    # a non-finite value on a padded position stays out of the loss (verl's masked_sum: torch.where)
    inf_pad = loss.masked_fill(mask == 0, float("inf"))
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert torch.isfinite(agg_loss(inf_pad, mask, mode)), mode
    with pytest.raises(ValueError, match="loss_agg_mode"):
        Aggregator("token-max")


def pg_inputs():
    old = torch.zeros(1, 4)
    new = torch.tensor([[LOG(1.5), LOG(0.5), LOG(4.0), LOG(1.1)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    return old, new, adv, torch.ones(1, 4)


def test_vanilla_is_ppo_clip_with_dual_clip():
    old, new, adv, mask = pg_inputs()
    loss, m = get_policy_loss("vanilla")(old, new, adv, mask, ClipParams(0.2, 0.2, 3.0), Aggregator())
    # per token: clipped -1.2 | unclipped -0.5 | dual-clipped 3 (not 4) | 1.1
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 3.0 + 1.1) / 4)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.25)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert m["actor/ppo_kl"].item() == pytest.approx(-LOG(1.5 * 0.5 * 4.0 * 1.1) / 4)
    loss.backward()
    # d/dlogp of -A * ratio is -A * ratio where unclipped; 0 where a clip binds
    assert new.grad[0].tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.1 / 4])
    assert get_policy_loss("dual_clip") is get_policy_loss("vanilla")


def test_gspo_follows_loss_agg_mode():
    """actor.loss_agg_mode chooses GSPO's aggregation, as verl's compute_policy_loss_gspo."""
    old = torch.zeros(2, 3)
    new = torch.tensor([[LOG(1.1), 0.0, 0.0], [LOG(1.1), LOG(1.1), LOG(1.1)]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    gspo = get_policy_loss("gspo")
    # seq 0: -1.1 on 1 token; seq 1: +1.1 on each of 3 tokens
    assert gspo(old, new, adv, mask, ClipParams(0.2, 0.2), Aggregator("token-mean"))[0].item() == \
        pytest.approx((-1.1 + 3 * 1.1) / 4)
    assert gspo(old, new, adv, mask, ClipParams(0.2, 0.2), Aggregator("seq-mean-token-mean"))[0].item() == \
        pytest.approx((-1.1 + 1.1) / 2)
    assert gspo(old, new, adv, mask, ClipParams(0.2, 0.2), Aggregator("seq-mean-token-sum"))[0].item() == \
        pytest.approx((-1.1 + 3 * 1.1) / 2)


def test_ppo_clip_without_dual_and_clip_higher():
    old, new, adv, mask = pg_inputs()
    loss, _ = get_policy_loss("ppo_clip")(old, new, adv, mask, ClipParams(0.2, 0.2, 3.0), Aggregator())
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 4.0 + 1.1) / 4)
    loss, _ = get_policy_loss("vanilla")(old, new, adv, mask, ClipParams(0.2, 0.28, 3.0), Aggregator())
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 3.0 + 1.1) / 4)


def test_gspo_sequence_ratio():
    old = torch.zeros(2, 3)
    new = torch.tensor([[LOG(1.1), LOG(1.3), 0.0], [LOG(2.0), LOG(2.0), 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    loss, m = get_policy_loss("gspo")(old, new, adv, mask, ClipParams(0.2, 0.2, None), Aggregator("token-mean"))
    s0 = math.sqrt(1.1 * 1.3)                     # geometric mean of the token ratios, inside the clip
    # seq 1 ratio 2 with A = -1: max(2, 1.2) = 2 (equal lengths: every mode gives the same value)
    assert loss.item() == pytest.approx((-s0 + 2.0) / 2)
    loss.backward()
    assert new.grad[0, :2].tolist() == pytest.approx([-s0 / 4, -s0 / 4])
    assert new.grad[1, :2].tolist() == pytest.approx([2.0 / 4, 2.0 / 4])
    assert new.grad[:, 2].tolist() == [0.0, 0.0]
    assert m["actor/pg_clipfrac"].item() == 0.0


def test_clipped_value_loss():
    v = torch.tensor([[1.0, 2.0]])
    old = torch.tensor([[0.5, 0.5]])
    ret = torch.tensor([[1.2, 2.5]])
    loss, m = value_loss(v, ret, old, torch.ones(1, 2), 0.5, Aggregator())
    # token 1: clipped prediction 1.0 -> (1.0 - 2.5)^2 = 2.25 beats (2 - 2.5)^2 = 0.25
    assert loss.item() == pytest.approx(0.5 * (0.04 + 2.25) / 2)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(0.5)


# -- the worker contract: loss and gradient independent of the micro-batch / DP split ------------
def cfg_with(**over):
    keys = {"loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
            "loss_mode": "actor_rollout_ref.actor.policy_loss.loss_mode",
            "entropy_coeff": "actor_rollout_ref.actor.entropy_coeff",
            "use_kl_loss": "actor_rollout_ref.actor.use_kl_loss",
            "kl_loss_type": "actor_rollout_ref.actor.kl_loss_type",
            "kl_loss_coef": "actor_rollout_ref.actor.kl_loss_coef",
            "rollout_is": "algorithm.rollout_correction.rollout_is", "critic_agg": "critic.loss_agg_mode",
            "clip_ratio_high": "actor_rollout_ref.actor.clip_ratio_high",
            "tau_pos": "actor_rollout_ref.actor.tau_pos", "tau_neg": "actor_rollout_ref.actor.tau_neg",
            "dro_beta": "actor_rollout_ref.actor.policy_loss.dro_beta"}
    return load_config(None, ["data.max_response_length=8", *(f"{keys[k]}={v}" for k, v in over.items())])


def random_batch(B=8, R=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lens[:, None]).long()
    mask[0, 1] = 0                                  # a tool token inside a response

    def t():
        return torch.randn(B, R, generator=g) * 0.3 - 1.0

    return DataProto.from_dict({"old_log_probs": t(), "ref_log_prob": t(), "rollout_log_probs": t(),
                                "advantages": torch.randn(B, R, generator=g), "response_mask": mask,
                                "values": torch.randn(B, R, generator=g), "returns": torch.randn(B, R, generator=g)})


def run_split(loss_fn, batch, theta, ent, parts, key="log_probs"):
    """Sum of micro-batch losses (and their gradients) over `parts`, each a list of row indices."""
    theta.grad = None
    ent.grad = None
    meta = {"global_tokens": batch.batch["response_mask"].sum().item(), "global_seqs": len(batch)}
    total = 0.0
    for rows in parts:
        mb = batch[rows]
        mb.meta_info.update(meta)
        outputs = {key: theta[rows], "entropy": ent[rows]}
        loss, metrics = loss_fn(outputs, mb)
        loss.backward()
        total += loss.item()
    return total, theta.grad.clone(), (ent.grad.clone() if ent.grad is not None else None), metrics


SPLITS = {"one": [list(range(8))], "micro4": [[0, 1], [2, 3], [4, 5], [6, 7]],
          "dp2_uneven": [[0, 1, 2], [3], [4, 5, 6, 7]]}


@pytest.mark.parametrize("over", [
    {"loss_agg_mode": "token-mean"},
    {"loss_agg_mode": "seq-mean-token-sum"},
    {"loss_agg_mode": "seq-mean-token-mean", "entropy_coeff": 0.01},
    {"loss_agg_mode": "seq-mean-token-sum-norm", "use_kl_loss": "true", "kl_loss_type": "low_var_kl"},
    {"loss_mode": "gspo", "clip_ratio_high": 0.3},
    {"loss_agg_mode": "token-mean", "rollout_is": "sequence", "use_kl_loss": "true", "kl_loss_type": "k3+",
     "entropy_coeff": 0.001},
])
def test_actor_loss_is_exact_however_split(over):
    batch = random_batch()
    loss_fn = make_actor_loss_fn(cfg_with(**over))
    g = torch.Generator().manual_seed(1)
    theta = (batch.batch["old_log_probs"] + 0.2 * torch.randn(8, 6, generator=g)).requires_grad_()
    ent = torch.rand(8, 6, generator=g).requires_grad_()
    ref_loss, ref_grad, ref_ent, _ = run_split(loss_fn, batch, theta, ent, SPLITS["one"])
    for name, parts in SPLITS.items():
        loss, grad, egrad, metrics = run_split(loss_fn, batch, theta, ent, parts)
        assert loss == pytest.approx(ref_loss, abs=1e-6), name
        assert torch.allclose(grad, ref_grad, atol=1e-7), name
        if ref_ent is not None:
            assert torch.allclose(egrad, ref_ent, atol=1e-7), name
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
            "actor/entropy"} <= set(metrics)
    if over.get("use_kl_loss"):
        assert "actor/kl_loss" in metrics


@pytest.mark.parametrize("over", [
    {"loss_mode": "gspo", "loss_agg_mode": "token-mean"}, {"loss_mode": "cispo", "loss_agg_mode": "token-sum"},
    {"loss_mode": "sapo", "tau_pos": 2.0, "tau_neg": 3.0}, {"loss_mode": "geo_mean"},
    {"loss_mode": "gpg", "loss_agg_mode": "seq-mean-token-sum-norm"}, {"loss_mode": "dro", "dro_beta": 0.2},
    {"loss_mode": "dppo_tv", "loss_agg_mode": "seq-mean-token-mean"}, {"loss_mode": "dppo_kl"},
])
def test_verl_variants_are_exact_however_split(over):
    """The worker contract for the losses whose tokens do not depend on the micro-batch (clip_cov and
    kl_cov choose theirs per micro-batch, as verl does); their values are verl's (test_verl_core_algos.py)."""
    batch = random_batch(seed=5)
    loss_fn = make_actor_loss_fn(cfg_with(**over))
    g = torch.Generator().manual_seed(2)
    theta = (batch.batch["old_log_probs"] + 0.2 * torch.randn(8, 6, generator=g)).requires_grad_()
    ent = torch.zeros(8, 6, requires_grad=True)
    ref_loss, ref_grad, _, _ = run_split(loss_fn, batch, theta, ent, SPLITS["one"])
    assert ref_grad.abs().sum() > 0
    for name, parts in SPLITS.items():
        loss, grad, _, metrics = run_split(loss_fn, batch, theta, ent, parts)
        assert loss == pytest.approx(ref_loss, abs=1e-6), name
        assert torch.allclose(grad, ref_grad, atol=1e-6), name
        assert "actor/pg_loss" in metrics


def test_clip_cov_metric_is_the_loss_it_trained_on():
    """clip_cov leaves a random few tokens out; the pg_loss metric is computed on those same tokens."""
    batch = random_batch(seed=7)
    theta = batch.batch["old_log_probs"] + 0.3 * torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    cfg = load_config(None, ["data.max_response_length=8", "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                             "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.3",
                             "actor_rollout_ref.actor.policy_loss.clip_cov_lb=-3",
                             "actor_rollout_ref.actor.policy_loss.clip_cov_ub=3"])
    for seed in range(5):
        torch.manual_seed(seed)
        loss, metrics = make_actor_loss_fn(cfg)({"log_probs": theta}, batch)
        assert float(metrics["actor/pg_clipfrac"]) > 0
        assert float(metrics["actor/pg_loss"]) == pytest.approx(loss.item(), abs=1e-7)


def test_variant_keys_reach_the_loss():
    """tau_pos / tau_neg (sapo) and dro_beta (dro) change the value: they are read, not just accepted."""
    batch = random_batch(seed=6)
    theta = batch.batch["old_log_probs"] + 0.3

    def value(**over):
        return make_actor_loss_fn(cfg_with(**over))({"log_probs": theta}, batch)[0].item()

    assert value(loss_mode="sapo", tau_pos=1.0, tau_neg=1.05) != value(loss_mode="sapo", tau_pos=4.0, tau_neg=6.0)
    assert value(loss_mode="dro", dro_beta=0.1) != value(loss_mode="dro", dro_beta=1.0)
    with pytest.raises(ConfigError, match="dro_beta"):
        cfg_with(loss_mode="dro")
    with pytest.raises(ConfigError, match="rollout_correction.bypass_mode"):
        cfg_with(loss_mode="bypass_mode")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_critic_loss_is_exact_however_split(mode):
    batch = random_batch(seed=3)
    loss_fn = make_critic_loss_fn(cfg_with(critic_agg=mode))
    theta = (batch.batch["values"] + 0.3).requires_grad_()
    ent = torch.zeros(8, 6, requires_grad=True)
    ref_loss, ref_grad, _, _ = run_split(loss_fn, batch, theta, ent, SPLITS["one"], key="values")
    loss, grad, _, metrics = run_split(loss_fn, batch, theta, ent, SPLITS["dp2_uneven"], key="values")
    assert loss == pytest.approx(ref_loss, abs=1e-6) and torch.allclose(grad, ref_grad, atol=1e-7)
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"} <= set(metrics)


def test_entropy_bonus_and_kl_loss_values():
    """One micro-batch, numbers by hand: loss = pg - c_ent * H + c_kl * KL."""
    mask = torch.ones(1, 2)
    mb = DataProto.from_dict({"old_log_probs": torch.zeros(1, 2), "advantages": torch.zeros(1, 2),
                              "response_mask": mask, "ref_log_prob": torch.full((1, 2), LOG(0.25))})
    logp = torch.full((1, 2), LOG(0.5))
    entropy = torch.tensor([[1.0, 3.0]])
    fn = make_actor_loss_fn(cfg_with(entropy_coeff=0.1, use_kl_loss="true", kl_loss_type="kl", kl_loss_coef=0.5))
    loss, m = fn({"log_probs": logp, "entropy": entropy}, mb)
    assert loss.item() == pytest.approx(0.0 - 0.1 * 2.0 + 0.5 * LOG(2.0))
    assert m["actor/entropy"].item() == pytest.approx(2.0)
    assert m["actor/kl_loss"].item() == pytest.approx(LOG(2.0))


def test_truncated_is_weights_scale_the_policy_loss():
    mask = torch.ones(1, 2)
    mb = DataProto.from_dict({"old_log_probs": torch.tensor([[LOG(0.5), LOG(0.4)]]),
                              "rollout_log_probs": torch.tensor([[LOG(0.25), LOG(0.4)]]),
                              "advantages": torch.ones(1, 2), "response_mask": mask})
    logp = mb.batch["old_log_probs"].clone()       # ratio 1, so each token's loss is -A * w
    plain = make_actor_loss_fn(cfg_with())({"log_probs": logp}, mb)[0].item()
    tok = make_actor_loss_fn(cfg_with(rollout_is="token"))({"log_probs": logp}, mb)[0].item()
    seq = make_actor_loss_fn(cfg_with(rollout_is="sequence"))({"log_probs": logp}, mb)[0].item()
    assert plain == pytest.approx(-1.0)
    assert tok == pytest.approx(-(2.0 + 1.0) / 2)    # token weights [2, 1] (threshold 2)
    assert seq == pytest.approx(-2.0)               # sequence weight 2 * 1 = 2 on both tokens


def test_missing_inputs_and_bad_names_are_named():
    mb = DataProto.from_dict({"old_log_probs": torch.zeros(1, 2), "advantages": torch.zeros(1, 2),
                              "response_mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="ref_log_prob"):
        make_actor_loss_fn(cfg_with(use_kl_loss="true"))({"log_probs": torch.zeros(1, 2)}, mb)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        make_actor_loss_fn(cfg_with(rollout_is="token"))({"log_probs": torch.zeros(1, 2)}, mb)
    with pytest.raises(ValueError, match="entropy"):
        make_actor_loss_fn(cfg_with(entropy_coeff=0.1))({"log_probs": torch.zeros(1, 2)}, mb)
    with pytest.raises(ConfigError, match="policy_loss.loss_mode: unknown policy loss 'gpso'; did you mean 'gspo'"):
        make_actor_loss_fn(cfg_with(loss_mode="gpso"))
    with pytest.raises(ConfigError, match="kl_loss_type"):
        make_actor_loss_fn(cfg_with(use_kl_loss="true", kl_loss_type="k9"))


def test_mean_metrics():
    assert mean_metrics([{"a": torch.tensor(1.0), "b": 2}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}
