"""Built-in reward rules and the default dispatcher by data source (`data.reward_fn_key`).

Every rule has the custom-function signature
    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict
and returns a dict with `score` (the reward) plus per-sample fields that are logged and can drive
DAPO's dynamic sampling (`acc`, `pred`).
"""
from __future__ import annotations

import re

from megarl.reward.math_answer import boxed_score, gsm8k_score

_INT = re.compile(r"\s*(-?\d+)\s*")


def integer_score(solution_str: str, ground_truth) -> dict:
    """Exact integer answer: the whole response (EOS stripped) must be the number, nothing else.
    Strict on purpose: the quickstart rewards stopping right after the answer."""
    m = _INT.fullmatch(solution_str)
    pred = m.group(1) if m else solution_str.strip()
    correct = bool(m) and int(m.group(1)) == int(str(ground_truth).strip())
    return {"score": float(correct), "acc": float(correct), "pred": pred}


# Format rewards: does the response follow the requested layout?
_FORMATS = {
    # exactly one <think>...</think> block at the start, followed by a non-empty answer
    "think": re.compile(r"\s*<think>(?:(?!</?think>).)*</think>\s*\S(?:(?!</?think>).)*", re.S),
    # exactly one <answer>...</answer> block with something inside
    "answer_tag": re.compile(r"(?:(?!</?answer>).)*<answer>(?:(?!</?answer>).)*\S(?:(?!</?answer>).)*</answer>(?:(?!</?answer>).)*", re.S),
}


def format_reward(solution_str: str, kind: str) -> float:
    """1.0 when `solution_str` follows format `kind` (think, answer_tag), else 0.0."""
    if kind not in _FORMATS:
        raise ValueError(f"unknown format reward {kind!r}; use one of {', '.join(_FORMATS)}")
    return float(bool(_FORMATS[kind].fullmatch(solution_str)))


GSM8K_SOURCES = {"openai/gsm8k", "gsm8k"}
MATH_SOURCES = {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math",
                "math_dapo", "math500", "aime", "aime24", "aime25", "amc", "numina_math", "deepscaler"}
INTEGER_SOURCES = {"addition", "megarl/addition", "integer"}


def rule_for(data_source: str):
    ds = str(data_source)
    if ds in GSM8K_SOURCES:
        return "gsm8k"
    if ds in MATH_SOURCES or ds.startswith(("aime", "math", "numina")):
        return "boxed"
    if ds in INTEGER_SOURCES:
        return "integer"
    return None


def check_data_sources(sources, key: str = "data.reward_fn_key") -> None:
    """Refuse data sources the default rules cannot score, before scoring anything."""
    unknown = sorted({str(s) for s in sources if rule_for(s) is None})
    if unknown:
        raise ValueError(f"no built-in reward rule for data source(s) {', '.join(map(repr, unknown[:5]))} "
                         f"(the {key} field); built in: gsm8k, MATH-style boxed answers, addition/integer; "
                         "set custom_reward_function.path to score other data")


def default_compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> dict:
    """Route by data source: GSM8K (`#### n`), MATH-style (`\\boxed{}`), integer exact match."""
    rule = rule_for(data_source)
    if rule == "gsm8k":
        return gsm8k_score(solution_str, ground_truth, **kwargs)
    if rule == "boxed":
        return boxed_score(solution_str, ground_truth, **kwargs)
    if rule == "integer":
        return integer_score(solution_str, ground_truth)
    check_data_sources([data_source])
    raise AssertionError("unreachable")
