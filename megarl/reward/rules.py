"""Built-in reward rules and the default dispatcher by data source (`data.reward_fn_key`).

Every rule has the custom-function signature
    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict
and returns a dict with `score` (the reward) plus per-sample fields that are logged and can drive
DAPO's dynamic sampling (`acc`, `pred`).
"""
from __future__ import annotations

import re
from collections.abc import Callable

from megarl.reward.math_answer import boxed_score, gsm8k_score
from megarl.reward.verl_math import answer_tag_em, gsm8k_exact, hendrycks_score, minerva_score

_INT = re.compile(r"\s*(-?\d+)\s*")


def integer_score(solution_str: str, ground_truth) -> dict:
    """Exact integer answer: the whole response (EOS stripped) must be the number, nothing else.
    Strict on purpose: the quickstart rewards stopping right after the answer."""
    m = _INT.fullmatch(solution_str)
    pred = m.group(1) if m else solution_str.strip()
    correct = m is not None and int(m.group(1)) == int(str(ground_truth).strip())
    return {"score": float(correct), "acc": float(correct), "pred": pred}


# Format rewards: does the response follow the requested layout?
_FORMATS = {
    # exactly one <think>...</think> block at the start, followed by a non-empty answer
    "think": re.compile(r"\s*<think>(?:(?!</?think>).)*</think>\s*\S(?:(?!</?think>).)*", re.S),
    # exactly one <answer>...</answer> block with something inside
    "answer_tag": re.compile(r"(?:(?!</?answer>).)*<answer>(?:(?!</?answer>).)*\S(?:(?!</?answer>).)*</answer>"
                             r"(?:(?!</?answer>).)*", re.S),
}


def format_reward(solution_str: str, kind: str) -> float:
    """1.0 when `solution_str` follows format `kind` (think, answer_tag), else 0.0."""
    if kind not in _FORMATS:
        raise ValueError(f"unknown format reward {kind!r}; use one of {', '.join(_FORMATS)}")
    return float(bool(_FORMATS[kind].fullmatch(solution_str)))


# verl 0.9.1's default_compute_score routes these; megarl applies the same rule (verl_math.py).
VERL_RULES = {"openai/gsm8k": "verl_gsm8k",
              "lighteval/MATH": "hendrycks", "DigitalLearningGmbH/MATH-lighteval": "hendrycks",
              "HuggingFaceH4/MATH-500": "hendrycks",
              "math_dapo": "minerva", "math": "minerva", "math_dapo_reasoning": "minerva",
              **{f"searchR1_{name}": "answer_em" for name in
                 ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")}}
# verl routes these to scorers megarl does not reimplement (sympy grading, running code): refused,
# because scoring them with another rule would train on rewards verl would not give.
VERL_ONLY = {"numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
             "numina_cn_k12", "numina_olympiads", "codecontests", "apps", "codeforces", "taco",
             "hiyouga/geometry3k"}
# Not routed by verl: megarl's own, more lenient rules (math_answer.py).
GSM8K_SOURCES = {"gsm8k"}
MATH_SOURCES = {"math500", "amc", "numina_math", "deepscaler"}
INTEGER_SOURCES = {"addition", "megarl/addition", "integer"}


def rule_for(data_source: str):
    ds = str(data_source)
    if ds in VERL_RULES:
        return VERL_RULES[ds]
    if ds.startswith("aime"):                              # verl: any aime* source gets math_dapo's rule
        return "minerva"
    if ds in VERL_ONLY:
        return None
    if ds in GSM8K_SOURCES:
        return "gsm8k"
    if ds in MATH_SOURCES or ds.startswith(("math", "numina")):
        return "boxed"
    if ds in INTEGER_SOURCES:
        return "integer"
    return None


def check_data_sources(sources, key: str = "data.reward_fn_key") -> None:
    """Refuse data sources the default rules cannot score, before scoring anything."""
    unknown = sorted({str(s) for s in sources if rule_for(s) is None})
    verl_only = [s for s in unknown if s in VERL_ONLY]
    if verl_only:
        raise ValueError(f"data source(s) {', '.join(map(repr, verl_only[:5]))} (the {key} field) need a verl "
                         "scorer megarl does not reimplement; set custom_reward_function.path to "
                         "verl/utils/reward_score/__init__.py and custom_reward_function.name=default_compute_score "
                         "(pip install verl) or to your own scorer")
    if unknown:
        raise ValueError(f"no built-in reward rule for data source(s) {', '.join(map(repr, unknown[:5]))} "
                         f"(the {key} field); built in: verl 0.9.1's gsm8k/MATH/math_dapo/aime/searchR1 rules, "
                         "gsm8k, MATH-style boxed answers, addition/integer; "
                         "set custom_reward_function.path to score other data")


_RULES: dict[str, Callable[..., dict]] = {
    "verl_gsm8k": gsm8k_exact, "hendrycks": hendrycks_score, "minerva": minerva_score, "answer_em": answer_tag_em,
    "gsm8k": gsm8k_score, "boxed": boxed_score}


def default_compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> dict:
    """Route by data source: verl's rule where verl routes it, else GSM8K (`#### n`), MATH-style
    (`\\boxed{}`), integer exact match."""
    rule = rule_for(data_source)
    if rule == "integer":
        return integer_score(solution_str, ground_truth)
    if rule in _RULES:
        return _RULES[rule](solution_str, ground_truth, **kwargs)
    check_data_sources([data_source])
    raise AssertionError("unreachable")
