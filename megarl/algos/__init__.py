"""RL algorithms as small pure tensor functions, chosen by name from the config.

    registry.py            the name registries, megarl's names declared without importing torch
    advantages.py          gae, grpo, drgrpo, rloo(_vectorized), opo, gpg, grpo_passk, reinforce_plus_plus(_baseline),
                           remax
    losses.py              policy losses (vanilla/dual_clip, ppo_clip, gspo), aggregation, value loss
    pg_variants.py         verl's other policy losses: cispo, sapo, geo_mean, clip_cov, kl_cov, gpg, dro, dppo_*
    decoupled.py           decoupled_ppo and m2po: a proximal policy apart from the behaviour policy
    loss_options.py        the keys those losses read beside loss_mode (clip_cov_*, dro_beta ...), torch-free
    staleness.py           weight versions of sampled tokens: staleness, its bound, its histogram
    kl.py                  KL estimators k1/k2/k3/abs, KL-in-reward with fixed/adaptive controllers
    loss_fn.py             make_actor_loss_fn / make_critic_loss_fn for the Megatron workers
    dapo.py                dynamic sampling and overlong reward shaping
    rollout_correction.py  rollout/trainer mismatch metrics and truncated importance sampling
    metrics.py             data, timing and throughput metrics with verl's names

Import names from the module that defines them (the package itself exports nothing).
"""
