"""megarl's default scorer against verl 0.9.1's own `default_compute_score`, answer by answer, for
every data source verl routes to a rule megarl reimplements (megarl/reward/verl_math.py).

    pip install --no-deps verl==0.9.1
    python -m pytest -q tests/test_verl_reward_oracle.py
"""
import importlib
import importlib.machinery
import os
import sys
import types

import pytest

from megarl.reward.rules import check_data_sources, default_compute_score

REASON = "the oracle is verl 0.9.1's scorer: pip install --no-deps verl==0.9.1"
if importlib.machinery.PathFinder.find_spec("verl") is None:    # sys.path only, never a stand-in module
    pytest.skip(REASON, allow_module_level=True)


def _verl_scorer():
    """verl.utils.reward_score without running verl/__init__.py, which needs tensordict and ray
    (not installed with --no-deps); the scorers themselves need only the standard library."""
    root = os.path.dirname(importlib.machinery.PathFinder.find_spec("verl").origin)
    saved = {k: sys.modules.get(k) for k in ("verl", "verl.utils")}
    try:
        for name, path in (("verl", root), ("verl.utils", os.path.join(root, "utils"))):
            if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
                stub = types.ModuleType(name)
                stub.__path__ = [path]
                sys.modules[name] = stub
        module = pytest.importorskip("verl.utils.reward_score", reason=REASON)
        for name in ("gsm8k", "math_reward", "math_dapo", "search_r1_like_qa_em"):
            importlib.import_module(f"verl.utils.reward_score.{name}")
        return module.default_compute_score
    finally:
        for name, old in saved.items():
            if old is not None:
                sys.modules[name] = old


verl_score = _verl_scorer()


def _score(out):
    return float(out["score"]) if isinstance(out, dict) else float(out)


B = "\\boxed"
MATH_CORPUS = [  # (response, ground truth)
    (f"so {B}{{72}}", "72"), (f"{B}{{72.0}}", "72"), ("Answer: 72", "72"), (f"{B}{{\\dfrac12}}", "\\frac{1}{2}"),
    (f"{B}{{\\frac12}}", "0.5"), (f"{B}{{1/2}}", "\\frac{1}{2}"), (f"{B}{{0.5}}", "\\frac{1}{2}"),
    (f"{B}{{x = 5}}", "5"), (f"{B}{{k=5}}", "5"), (f"{B}{{10\\%}}", "10"), (f"{B}{{90^\\circ}}", "90"),
    (f"{B}{{5 \\text{{ cm}}}}", "5"), (f"{B}{{\\$1,000}}", "1000"), (f"{B}{{\\left( 1, 2 \\right)}}", "(1,2)"),
    (f"{B}{{\\sqrt2}}", "\\sqrt{2}"), (f"{B}{{.5}}", "0.5"), (f"{B} 7$ done", "7"), ("\\fbox{7}", "7"),
    (f"{B}{{unbalanced", "3"), ("no box, the answer is 3", "3"),
    (f"{B}{{\\frac{{3}}{{4}}}} wait {B}{{\\frac34}}", "\\frac{3}{4}"),
    (f"{B}{{\\sqrt}}", "\\sqrt"), (f"{B}{{\\frac}}", "\\frac"),
    (f"{B}{{a \\text{{ b}} \\text{{ c}}}}", "a \\text{ b} \\text{ c}"),
    (f"{B}{{\\frac1}}", "\\frac1"), (f"{B}{{\\tfrac{{6}}{{8}}}}", "\\frac{6}{8}"), (f"{B}{{B}}", "(B)"),
    (f"{B}{{-3}}", "-3"), (f"{B}{{3}}", "\\boxed{3}"), (f"{B}{{1,2}}", "12"), (f"{B}{{\\text{{(B)}}}}", "B"),
    (f"{B}{{033}}", "33"), (f"{B}{{ 033 }}", "033"), ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("Answer: 1,000 dollars", "1000"), ("answer : \\text{5 feet}", "5"), ("Answer: x = 7.", "7"),
    ("Answer: 7\nmore text", "7"), ("Answer: 6\nAnswer: 7", "7"), (f"Answer: 8 {B}{{7}}", "7"),
    ("Answer: \\frac34", "\\frac{3}{4}"), ("Answer: \\sqrt3", "\\sqrt{3}"), ("Answer: \\boxed{12}", "12"),
    ("Answer: an apple", "apple"), ("Answer: 12^{\\circ}", "12"), ("Answer: \\overline{AB}", "AB"),
    ("Answer: 3 \\text{ and } 4", "3,4"), ("Answer: $5$ and $6$", "5"), ("Answer: 1,234,567", "1234567"),
    ("Answer:", "0"), ("x" * 400 + f"{B}{{9}}", "9"), (f"{B}{{9}}" + "y" * 120, "9"), (f"{B}{{9}}" + "z" * 290, "9"),
    ("Answer: 5" + "w" * 310, "5"), ("", "1"), ("Answer: [INVALID]", "3"), (f"{B}{{{{nested}}}}", "{nested}"),
    ("The final answer is $\\boxed{\\text{Monday}}$.", "\\text{Monday}"), (f"{B}{{2\\!\\cdot\\!3}}", "2\\cdot3"),
    (f"{B}{{\\pi/2}}", "\\frac{\\pi}{2}"), (f"{B}{{3/4}}", "3/4"), (f"{B}{{-1/2}}", "-\\frac{1}{2}"),
]
GSM8K_CORPUS = [
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "7"), ("#### 1,234", "1234"), ("#### 72.0", "72"),
    ("first #### 5 then #### -12.50", "-12.50"), ("#### $18", "18"), ("The answer is 42.", "42"),
    ("####18", "18"), ("#### 18.", "18"), ("#### 18" + " padding" * 60, "18"), ("#### 3", "4"), ("", "0"),
    ("#### .", "."), ("#### -3", "-3"), ("#### 1,2", "12"),
]
SEARCH_CORPUS = [
    ("<answer>Paris</answer>", {"target": ["Paris"]}), ("<answer> the Paris. </answer>", {"target": ["paris"]}),
    ("<answer>Lyon</answer>", {"target": ["Paris", "Lyon"]}), ("<answer>Rome</answer>", {"target": ["Paris"]}),
    ("no tag Paris", {"target": ["Paris"]}),
    ("<answer>x</answer>" * 11 + "<answer>Paris</answer>", {"target": ["Paris"]}),
    ("<answer>a</answer><answer>Paris</answer>", {"target": "Paris"}),
    ("<answer>\nParis\n</answer>", {"target": ["Paris"]}),
]


# verl 0.9.1's routing table (verl/utils/reward_score/__init__.py), written out here so that the
# test does not take megarl's word for which sources verl routes; aime* stands for any aime prefix.
ROUTED = {"openai/gsm8k": GSM8K_CORPUS, "lighteval/MATH": MATH_CORPUS,
          "DigitalLearningGmbH/MATH-lighteval": MATH_CORPUS,
          "HuggingFaceH4/MATH-500": MATH_CORPUS, "math_dapo": MATH_CORPUS, "math": MATH_CORPUS,
          "math_dapo_reasoning": MATH_CORPUS, "aime": MATH_CORPUS, "aime24": MATH_CORPUS, "aime2025": MATH_CORPUS,
          **{f"searchR1_{name}": SEARCH_CORPUS for name in
             ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")}}
NOT_REIMPLEMENTED = ["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                     "numina_cn_k12", "numina_olympiads", "codecontests", "apps", "codeforces", "taco",
                     "hiyouga/geometry3k"]


def _cases():
    for source, corpus in ROUTED.items():
        for i, (text, truth) in enumerate(corpus):
            yield pytest.param(source, text, truth, id=f"{source}-{i}")


@pytest.mark.parametrize("source, text, truth", list(_cases()))
def test_same_score_as_verl(source, text, truth):
    assert (_score(default_compute_score(source, text, truth))
            == _score(verl_score(source, text, truth))), (source, text, truth)


def test_dapo_answer_line_rule():
    """The reported case: math_dapo reads "Answer: X" (+1/-1), and a boxed answer only without one."""
    assert default_compute_score("math_dapo", "Answer: 72", "72")["score"] == 1.0
    assert default_compute_score("math_dapo", "Answer: 71", "72")["score"] == -1.0
    assert default_compute_score("math_dapo", "Answer: 71 \\boxed{72}", "72")["score"] == -1.0
    assert default_compute_score("aime24", "Answer: 72", "72")["score"] == 1.0


@pytest.mark.parametrize("truth", [72, 72.0])
@pytest.mark.parametrize("source", ["math_dapo", "math_dapo_reasoning", "aime24"])
def test_dapo_number_ground_truth_is_refused_as_verl_fails(source, truth):
    """verl's math_dapo reads the ground truth as text and fails on a number; megarl refuses it too, in one
    line naming the fix, instead of scoring 72 right and 72.0 wrong."""
    with pytest.raises(AttributeError):
        verl_score(source, "Answer: 72", truth)
    with pytest.raises(TypeError) as err:
        default_compute_score(source, "Answer: 72", truth)
    assert "ground_truth as a string" in str(err.value) and "\n" not in str(err.value)


def test_sources_verl_grades_otherwise_are_refused():
    """verl's sympy/code/geometry scorers are not reimplemented: refuse rather than score differently."""
    for source in NOT_REIMPLEMENTED:
        with pytest.raises(ValueError, match="custom_reward_function.name=default_compute_score"):
            check_data_sources([source])
