"""Rewards: rule functions, custom functions by path, reward managers, and a Ray scoring pool.

    math_answer.py  GSM8K `#### n` and `\\boxed{}` answer checking
    rules.py        default_compute_score (dispatch by data source), integer and format rewards
    loading.py      a user's function or manager class by path, signatures checked up front
    scorers.py      the Scorer protocol and one class per way of scoring (rules or a function per sample,
                    in process or in the Ray pool; a batched function; a user's manager class)
    manager.py      RewardManager: batch in, token_level_scores [B, R] + per-sample info out
    result.py       RewardResult, and a class's or reward model's tensors read as token-level scores
    settings.py     RewardSettings: what the manager reads from the experiment's tree
    pool.py         the Ray actor pool: parallel scoring with a per-sample timeout

Import names from the module that defines them (the package itself exports nothing).
"""
