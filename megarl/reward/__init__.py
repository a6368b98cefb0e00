"""Rewards: rule functions, custom functions by path, reward managers, and a Ray scoring pool.

    math_answer.py  GSM8K `#### n` and `\\boxed{}` answer checking
    rules.py        default_compute_score (dispatch by data source), integer and format rewards
    loading.py      a user's function or manager class by path, signatures checked up front
    manager.py      RewardManager: batch in, token_level_scores [B, R] + per-sample info out
    pool.py         the Ray actor pool: parallel scoring with a per-sample timeout

Import names from the module that defines them (the package itself exports nothing).
"""
