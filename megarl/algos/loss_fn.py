"""The actor's and critic's per-micro-batch loss functions, built once from the config.

    loss_fn = make_actor_loss_fn(cfg)                 # cfg: ExperimentConfig
    loss, metrics = loss_fn(outputs, micro_batch)     # outputs: {"log_probs": [b, R], "entropy": [b, R]}

`micro_batch` is a DataProto carrying old_log_probs, advantages, response_mask and, when used,
ref_log_prob, rollout_log_probs. Its meta_info gives `global_tokens` and `global_seqs` (the
mini-batch's totals over all micro-batches and DP ranks); the returned loss is this micro-batch's
share, so summing the gradients of all shares gives exactly the mini-batch loss's gradient.
Metrics are detached scalars, each a mean over this micro-batch: average them over micro-batches.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields

import torch

import megarl.algos.decoupled  # noqa: F401  (registers the decoupled_ppo and m2po policy losses)
import megarl.algos.pg_variants  # noqa: F401  (registers cispo, sapo, geo_mean, clip_cov, kl_cov, ...)
from megarl.algos import loss_options
from megarl.algos.kl import KL_ESTIMATORS, kl_penalty
from megarl.algos.losses import Aggregator, ClipParams, get_policy_loss, value_loss
from megarl.algos.rollout_correction import MASKING, masked_token_fraction, rollout_is_weights, rollout_mismatch_metrics
from megarl.algos.tensor_ops import masked_mean
from megarl.config.errors import ConfigError

LossFn = Callable[[dict, object], tuple[torch.Tensor, dict]]


def _aggregator(mode: str, micro_batch, norm_len: int | None) -> Aggregator:
    meta = micro_batch.meta_info
    return Aggregator(mode, meta.get("global_tokens"), meta.get("global_seqs"), norm_len)


def _check_kl_type(kind: str, key: str) -> None:
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ConfigError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS.names())} "
                          "(a '+' suffix takes the k2 gradient)", key)


def make_actor_loss_fn(cfg, mismatch_rows: int = 0) -> LossFn:
    """PPO-family policy loss + entropy bonus + optional KL-to-reference loss + optional TIS.

    mismatch_rows > 0 (bypass mode, megarl/trainer/loop/bypass.py): the first `mismatch_rows` rows this
    rank's loss sees after `loss_fn.start_update()` are the first mini-batch, forwarded before any
    optimizer step, so their log-probs are the old policy's: the rollout/trainer mismatch metrics
    (rollout_corr/*) are measured on them at no extra cost, each a mean over micro-batches."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    policy_loss, pl = get_policy_loss(actor.policy_loss.loss_mode), actor.policy_loss
    # megarl's own losses read their options as the ClipParams fields of the same names (verl's oracle
    # tests call them that way); any loss finds its whole options object in params.options
    builtin = pl.options is not None and type(pl.options).__module__ == loss_options.__name__
    named = {f.name: getattr(pl.options, f.name) for f in fields(pl.options)} if builtin else {}
    params = ClipParams(clip_low=actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low,
                        clip_high=actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high,
                        clip_c=actor.clip_ratio_c, tau_pos=actor.tau_pos, tau_neg=actor.tau_neg, options=pl.options,
                        **named)
    decoupled = getattr(policy_loss, "needs_behaviour_log_probs", False)
    if decoupled and algo.rollout_correction.rollout_is is not None:
        raise ConfigError(f"loss_mode={actor.policy_loss.loss_mode} already weights tokens by pi_prox / pi_behav; "
                          "remove algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is")
    if actor.use_kl_loss:
        _check_kl_type(actor.kl_loss_type, "actor_rollout_ref.actor.kl_loss_type")
    correction = algo.rollout_correction
    norm_len = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    mode = actor.loss_agg_mode
    seen = [0]                                                                   # rows since start_update()

    def loss_fn(outputs: dict, micro_batch) -> tuple[torch.Tensor, dict]:
        b = micro_batch.batch
        log_prob = outputs["log_probs"]                                          # [b, R]
        mask = b["response_mask"].to(log_prob.device)
        probe = seen[0] < mismatch_rows
        seen[0] += len(micro_batch)
        old = b["old_log_probs"] if "old_log_probs" in b else log_prob.detach()   # on-policy: ratio 1
        agg = _aggregator(mode, micro_batch, norm_len)
        weights = None
        if correction.rollout_is is not None:
            if "rollout_log_probs" not in b:
                raise ValueError("algorithm.rollout_correction.rollout_is is set but the batch has no "
                                 "rollout_log_probs; the rollout engine must return log-probs")
            weights = rollout_is_weights(old, b["rollout_log_probs"], mask, correction.rollout_is,
                                         correction.rollout_is_threshold)
        behav = {}
        if decoupled:
            if "rollout_log_probs" not in b:
                raise ValueError(f"loss_mode={actor.policy_loss.loss_mode} needs the batch's rollout_log_probs "
                                 "(the behaviour policy); the rollout engine must return log-probs")
            behav = {"behav_log_prob": b["rollout_log_probs"]}
        rng = torch.get_rng_state()          # clip_cov draws its tokens: the metric below redraws the same
        pg_loss, metrics = policy_loss(old, log_prob, b["advantages"], mask, params, agg, is_weights=weights, **behav)
        loss = pg_loss
        if weights is not None:
            metrics["rollout_corr/rollout_is_mean"] = masked_mean(weights, mask)
            if correction.rollout_is in MASKING:
                metrics["rollout_corr/masked_token_fraction"] = torch.tensor(masked_token_fraction(weights, mask))
        metrics["actor/pg_loss"] = _local(policy_loss, old, log_prob, b["advantages"], mask, params, agg, weights,
                                          rng, **behav)
        if probe:
            metrics.update(rollout_mismatch_metrics(log_prob.detach(), b["rollout_log_probs"].to(log_prob.device),
                                                    mask))
        entropy = outputs.get("entropy")
        if entropy is not None:
            metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        if actor.entropy_coeff:
            if entropy is None:
                raise ValueError("actor.entropy_coeff > 0 needs the worker to return per-token entropy")
            loss = loss - actor.entropy_coeff * agg(entropy, mask)
        if actor.use_kl_loss:
            if "ref_log_prob" not in b:
                raise ValueError("actor.use_kl_loss is set but the batch has no ref_log_prob; the reference pass "
                                 "must run before the update")
            kld = kl_penalty(log_prob, b["ref_log_prob"], actor.kl_loss_type)     # [b, R]
            loss = loss + actor.kl_loss_coef * agg(kld, mask)
            metrics["actor/kl_loss"] = agg.local()(kld.detach(), mask)
            metrics["actor/kl_coef"] = torch.tensor(actor.kl_loss_coef)
        return loss, metrics

    loss_fn.start_update = lambda: seen.__setitem__(0, 0)  # type: ignore[attr-defined]  # a function's attribute
    return loss_fn


@torch.no_grad()
def _local(policy_loss, old, log_prob, adv, mask, params, agg, weights, rng, **behav) -> torch.Tensor:
    """The micro-batch's own policy loss value (for the metric), independent of global counts. Run from
    the generator state the loss started from (`rng`), so a loss that draws tokens draws the same ones,
    and the generator is left where the loss left it."""
    after = torch.get_rng_state()
    torch.set_rng_state(rng)
    value, _ = policy_loss(old, log_prob.detach(), adv, mask, params, agg.local(), is_weights=weights, **behav)
    torch.set_rng_state(after)
    return value


def make_critic_loss_fn(cfg) -> LossFn:
    """Clipped value loss. outputs: {"values": [b, R]}; micro_batch: values (old), returns, response_mask."""
    critic = cfg.critic
    norm_len = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length

    def loss_fn(outputs: dict, micro_batch) -> tuple[torch.Tensor, dict]:
        b = micro_batch.batch
        vpreds = outputs["values"]
        mask = b["response_mask"].to(vpreds.device)
        agg = _aggregator(critic.loss_agg_mode, micro_batch, norm_len)
        loss, metrics = value_loss(vpreds, b["returns"], b["values"], mask, critic.cliprange_value, agg)
        with torch.no_grad():
            metrics["critic/vf_loss"] = value_loss(vpreds.detach(), b["returns"], b["values"], mask,
                                                   critic.cliprange_value, agg.local())[0]
        return loss, metrics

    return loss_fn


def mean_metrics(per_micro_batch: Iterable[dict]) -> dict[str, float]:
    """Average each metric over the micro-batches that reported it (tensors or floats)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in per_micro_batch:
        for key, value in metrics.items():
            value = value.item() if isinstance(value, torch.Tensor) else float(value)
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}
