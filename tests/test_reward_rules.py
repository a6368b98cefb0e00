"""Rule rewards: GSM8K, boxed answers with normalisation, integer exact match, format rewards."""
import pytest

from megarl.reward.math_answer import (answers_match, boxed_score, extract_gsm8k, gsm8k_score, last_boxed,
                                       normalize_answer)
from megarl.reward.rules import check_data_sources, default_compute_score, format_reward, integer_score


@pytest.mark.parametrize("text, strict, flexible", [
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "7", "7"),
    ("#### 1,234", "1234", "1234"),
    ("first #### 5 then #### $-12.50", "-12.50", "-12.50"),
    ("The answer is 42.", None, "42"),
    ("no digits here", None, None),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_gsm8k(text, "strict") == strict
    assert extract_gsm8k(text, "flexible") == flexible


def test_gsm8k_score():
    assert gsm8k_score("so #### 1,234", "1234")["score"] == 1.0
    assert gsm8k_score("#### 72.0", "72")["score"] == 1.0                  # numeric equality
    assert gsm8k_score("#### 71", "72", format_score=0.1)["score"] == 0.1  # right form, wrong value
    assert gsm8k_score("it is 72", "72")["score"] == 0.0                   # strict needs ####
    assert gsm8k_score("it is 72", "72", method="flexible")["score"] == 1.0
    # the dataset's own full solution works as ground truth
    assert gsm8k_score("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... #### 18")["acc"] == 1.0


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}} wait \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("nested \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
    ("$\\boxed 7$", "7"),
    ("\\fbox{x}", "x"),
    ("\\boxed{unbalanced", None),
    ("nothing boxed", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("pred, truth", [
    ("\\dfrac12", "\\frac{1}{2}"), ("\\frac12", "0.5"), ("1/2", "\\frac{1}{2}"), ("0.50", "\\frac{1}{2}"),
    ("x = 5", "5"), ("10\\%", "10"), ("90^\\circ", "90"), ("5 \\text{ cm}", "5"), ("\\$1,000", "1000"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("\\sqrt2", "\\sqrt{2}"), ("\\text{(B)}", "B"), (".5", "0.5"),
    ("-\\frac{3}{4}", "-0.75"), ("\\tfrac{6}{8}", "\\frac{3}{4}"),
])
def test_equivalent_answers(pred, truth):
    assert answers_match(pred, truth), (normalize_answer(pred), normalize_answer(truth))


@pytest.mark.parametrize("pred, truth", [("3", "4"), ("\\frac{1}{3}", "0.33"), ("(1,2)", "(2,1)"),
                                         ("\\sqrt{3}", "\\sqrt{2}"), ("12", "1,2")])
def test_different_answers(pred, truth):
    assert not answers_match(pred, truth)


def test_boxed_score():
    r = boxed_score("The area is \\boxed{\\dfrac{3}{4}}", "\\boxed{0.75}")
    assert r == {"score": 1.0, "acc": 1.0, "pred": "\\dfrac{3}{4}"}
    assert boxed_score("The area is 0.75", "0.75")["score"] == 0.0


@pytest.mark.parametrize("text, truth, ok", [("168", "168", True), (" 168 ", 168, True), ("1688", "168", False),
                                             ("168+1", "168", False), ("", "168", False), ("-5", "-5", True)])
def test_integer_exact_match(text, truth, ok):
    assert integer_score(text, truth)["score"] == float(ok)


@pytest.mark.parametrize("text, kind, ok", [
    ("<think>carry the one</think> 168", "think", True),
    ("<think>a</think>\n\\boxed{5}", "think", True),
    ("168", "think", False),
    ("<think>a</think>", "think", False),                                   # nothing after the thinking
    ("<think>a</think><think>b</think>5", "think", False),
    ("I think <answer>42</answer>", "answer_tag", True),
    ("<answer></answer>", "answer_tag", False),
    ("<answer>1</answer><answer>2</answer>", "answer_tag", False),
])
def test_format_rewards(text, kind, ok):
    assert format_reward(text, kind) == float(ok)


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 3", "3")["score"] == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "3")["score"] == 1.0
    # aime* follows verl's math_dapo rule: a boxed answer is compared as written, +1/-1
    assert default_compute_score("aime24", "\\boxed{033}", "33")["score"] == -1.0
    assert default_compute_score("aime24", "Answer: 33", "33")["score"] == 1.0
    assert default_compute_score("math500", "\\boxed{033}", "33")["score"] == 1.0     # megarl's own rule
    assert default_compute_score("gsm8k", "#### 72.0", "72")["score"] == 1.0
    assert default_compute_score("openai/gsm8k", "#### 72.0", "72")["score"] == 0.0    # verl: text equality
    assert default_compute_score("addition", "12", "12")["score"] == 1.0
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        default_compute_score("my_private_set", "x", "y")
    with pytest.raises(ValueError, match="'a', 'b'"):
        check_data_sources(["gsm8k", "b", "a"])
