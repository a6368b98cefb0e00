"""Rule-based answer checking for math: GSM8K's `#### n` and LaTeX `\\boxed{...}` answers.

    gsm8k_score("... #### 1,234", "1234")        -> {"score": 1.0, "acc": 1.0, "pred": "1234"}
    boxed_score("so \\boxed{\\dfrac12}", "0.5")  -> {"score": 1.0, ...}

Answers compare equal when their normalised strings match or when both parse to the same number
(integers, decimals, `a/b`, `\\frac{a}{b}`, thousands separators, a trailing `%` or unit text).
"""
from __future__ import annotations

import re
from fractions import Fraction

_GSM8K_STRICT = re.compile(r"####\s*(\$?-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")


def extract_gsm8k(text: str, method: str = "strict") -> str | None:
    """The answer after the last `####` (strict), or the last number in the text (flexible)."""
    if method == "strict":
        hits = _GSM8K_STRICT.findall(text)
        return hits[-1].replace(",", "").replace("$", "") if hits else None
    if method == "flexible":
        hits = [h for h in _NUMBER.findall(text) if h.strip("$.,-")]
        return hits[-1].replace(",", "").replace("$", "").rstrip(".") if hits else None
    raise ValueError(f"unknown gsm8k extraction method {method!r}; use strict or flexible")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces matched), or of
    `\\boxed 5` (up to the next `$` or whitespace)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if i < len(text) and text[i] == " ":
        m = re.match(r"\s*([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None                                            # unbalanced: no answer


def _strip_text_commands(s: str) -> str:
    # \text{cm}, \mbox{ m} around units or wrapped answers: keep the inner text.
    return re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}."""
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)


def normalize_answer(ans: str) -> str:
    """Canonical text of a math answer (whitespace, LaTeX spacing and sizing, units dropped)."""
    s = ans.strip().replace("\n", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _strip_text_commands(s)
    s = re.sub(r"\s*(cm|m|km|kg|g|s|mph|degrees|dollars|units?)\s*$", "", s)
    s = s.replace(" ", "")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)                    # "x=5" -> "5"
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    if s.startswith("."):
        s = "0" + s
    s = s.rstrip(".")
    m = re.fullmatch(r"\(([A-Za-z])\)", s)                  # multiple choice "(B)" -> "B"
    return m.group(1) if m else s


def to_number(s: str) -> Fraction | None:
    """A normalised answer as an exact number, when it is one."""
    t = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", t) or re.fullmatch(r"(-?)(-?\d+)/(-?\d+)", t)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", t):
            return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(pred: str | None, truth: str) -> bool:
    if pred is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(str(truth))
    if a == b:
        return True
    na, nb = to_number(a), to_number(b)
    return na is not None and nb is not None and na == nb


def _result(correct: bool, pred: str | None, score: float, format_score: float) -> dict:
    value = score if correct else (format_score if pred is not None else 0.0)
    return {"score": float(value), "acc": float(correct), "pred": pred if pred is not None else ""}


def gsm8k_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> dict:
    """GSM8K: `score` for the right `#### n`, `format_score` for a wrong but well-formed one."""
    truth = str(ground_truth)
    truth = extract_gsm8k(truth) or truth                  # the dataset's full solution text works too
    pred = extract_gsm8k(solution_str, method)
    return _result(answers_match(pred, truth), pred, score, format_score)


def boxed_score(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> dict:
    """MATH-style: the last `\\boxed{}` against the ground truth (itself boxed or plain)."""
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    pred = last_boxed(solution_str)
    return _result(answers_match(pred, truth), pred, score, format_score)
