"""The rules verl 0.9.1's `default_compute_score` applies to the data sources it routes, rewritten
so that a verl recipe's data scores the same here (tests/test_verl_reward_oracle.py runs verl's
own scorer beside these):

    hendrycks_score   lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500:
                      last \\boxed{} against the ground truth after the Hendrycks MATH
                      normalisation; 1.0 / 0.0
    minerva_score     math_dapo, math, math_dapo_reasoning, aime*: the last "Answer: X" line
                      (Minerva normalisation), else the last \\boxed{} in the final 100
                      characters compared verbatim; +1.0 / -1.0
    gsm8k_exact       openai/gsm8k: the last "#### n" in the final 300 characters, commas
                      dropped, equal as text to the ground truth; 1.0 / 0.0
    answer_tag_em     searchR1_*: <answer>...</answer> exact match against ground_truth["target"]

These are stricter than megarl's own rules (math_answer.py): "72.0" is not "72", and a boxed
answer under math_dapo only counts when no "Answer:" line exists. Agreement with verl is the point.
"""
from __future__ import annotations

import re
import string as _string


class _Malformed(Exception):
    """Normalisation hit input that verl's normaliser fails on; verl then compares raw text."""


# ----------------------------------------------------------------------------- boxed extraction
def _brace_span(text: str, start: int) -> str | None:
    """text[start:] up to the brace that closes the first one opened (None when never closed)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "{}":
            depth += 1 if text[i] == "{" else -1
            if depth == 0:
                return text[start:i + 1]
    return None


def _boxed_inner(box: str | None) -> str | None:
    """The content of `\\boxed{...}`; anything else (\\fbox, \\boxed7}) counts as no answer."""
    if box is None or not box.startswith("\\boxed{") or not box.endswith("}"):
        return None
    return box[len("\\boxed{"):-1]


def hendrycks_boxed(text: str) -> str | None:
    """MATH's answer: after the last `\\boxed ` (to the next `$`), else the last \\boxed{...}."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    start = start if start >= 0 else text.rfind("\\fbox")
    return None if start < 0 else _boxed_inner(_brace_span(text, start))


# ----------------------------------------------------------------------------- MATH (Hendrycks)
def _sqrt_braced(s: str) -> str:
    head, *rest = s.split("\\sqrt")
    for part in rest:
        if not part:
            raise _Malformed(s)
        head += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return head


def _frac_braced(s: str) -> str:
    head, *rest = s.split("\\frac")
    for part in rest:
        if not part:
            raise _Malformed(s)
        if part[0] == "{":
            head += "\\frac" + part
        elif len(part) < 2:
            return s                                        # "\frac1": left as written
        elif part[1] == "{":
            head += "\\frac{" + part[0] + "}" + part[1:]
        else:
            head += "\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return head


def _slash_as_frac(s: str) -> str:
    num, sep, den = s.partition("/")
    if "/" in den or not sep:
        return s
    try:
        a, b = int(num), int(den)
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def hendrycks_normalise(s: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:                                   # a unit written after the number
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise _Malformed(s)
        s = pieces[0]
    s = s.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:           # "k = 5" -> "5"
        s = rhs
    s = _frac_braced(_sqrt_braced(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def hendrycks_equal(pred: str, truth) -> bool:
    try:
        return hendrycks_normalise(pred) == hendrycks_normalise(truth)
    except (_Malformed, AttributeError, TypeError):
        return pred == truth


def hendrycks_score(solution_str: str, ground_truth, **_) -> dict:
    pred = hendrycks_boxed(solution_str)
    correct = pred is not None and hendrycks_equal(pred, ground_truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}


# ----------------------------------------------------------------------------- DAPO / Minerva
_DROPPED_WORDS = ("square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits "
                  "cents degrees cm gm pounds meters meals edges students childrentickets multiples").split()
_DROPPED_TEX = ["\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
                "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"]
_REWRITES = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_INVALID = "[INVALID]"


def minerva_normalise(ans: str) -> str:
    ans = ans.split("=")[-1]
    for old, new in _REWRITES:
        ans = ans.replace(old, new)
    for word in _DROPPED_WORDS + _DROPPED_TEX:            # order matters: "\text{}" after "\text{}^2"
        ans = ans.replace(word, "")
    ans = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", ans)  # keep the first $...$ only
    for command in ("text", "textbf", "overline"):
        ans = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", ans)
    ans = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", ans)
    ans = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", ans)
    ans = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", ans).replace("$", "")
    if ans.replace(",", "").isdigit():
        ans = ans.replace(",", "")
    return ans.strip()


def _last_boxed_brace(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    return None if start < 0 else _boxed_inner(_brace_span(text, start))


def minerva_score(solution_str: str, ground_truth, strict_box_verify: bool = False, **_) -> dict:
    """+1/-1 like verl's math_dapo: "Answer: X" first; a boxed answer only when there is no such line."""
    if not isinstance(ground_truth, str):
        # verl's rule reads the ground truth as text and fails on a number; str() would score 72 but not
        # 72.0 against "Answer: 72", so a number is refused (at --check on the first row, else per sample)
        raise TypeError(f"the math_dapo rule (verl's) compares answers as text, but this row's ground_truth is "
                        f"{type(ground_truth).__name__} {ground_truth!r}; write reward_model.ground_truth as a "
                        f"string in the data (e.g. \"{ground_truth}\")")
    text, truth = solution_str[-300:], ground_truth
    boxed = _last_boxed_brace(text[-100:])
    if strict_box_verify:
        correct, pred = boxed == truth, boxed
    else:
        lines = _ANSWER_LINE.findall(text)
        pred = minerva_normalise(lines[-1] if lines else _INVALID)
        correct = pred == minerva_normalise(truth)
        if pred == _INVALID and boxed is not None:
            correct, pred = boxed == truth, boxed
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}


# ----------------------------------------------------------------------------- GSM8K
_GSM8K_HASH = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_ANY = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_exact(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0, **_) -> dict:
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown gsm8k extraction method {method!r}; use strict or flexible")
    tail = solution_str[-300:]                            # verl reads only the end of the response
    if method == "strict":
        hits = _GSM8K_HASH.findall(tail)
        pred = hits[-1].replace(",", "") if hits else None
    else:
        found = _GSM8K_ANY.findall(tail)
        numbers = [h for h in found if h != "."]
        # only lone dots: verl's search ends on the first of them
        pred = numbers[-1] if numbers else (found[0] if found else None)
    correct = pred is not None and pred == ground_truth
    value = 0.0 if pred is None else (score if correct else format_score)
    return {"score": float(value), "acc": float(correct), "pred": pred or ""}


# ----------------------------------------------------------------------------- Search-R1
def _em_text(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def answer_tag_em(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0, **_) -> dict:
    """Exact match of the last <answer>...</answer> against any of ground_truth["target"]."""
    found = re.findall(r"<answer>(.*?)</answer>", solution_str, re.S)
    if not found:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    pred = found[-1].strip()
    targets = ground_truth["target"]
    targets = [targets] if isinstance(targets, str) else targets
    correct = any(_em_text(t) == _em_text(pred) for t in targets)
    spammed = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > 10
    value = (score / 4 if spammed else score) if correct else format_score
    return {"score": float(value), "acc": float(correct), "pred": pred}
