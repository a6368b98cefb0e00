"""Reward for tool use: was the right tool called, and is the final answer right (verl's
`compute_reward` idea, in megarl's custom-reward-function form).

    custom_reward_function:
      path: megarl/examples/tool_use/reward.py
      name: compute_score
      reward_kwargs: {tool: calculator, tool_weight: 0.5}

compute_score(data_source, solution_str, ground_truth, extra_info=None, tool="calculator",
tool_weight=0.5) -> {"score", "tool_called", "acc"}: `tool_weight` for a successful call of `tool`,
the rest for a final answer equal to the ground truth (the last number after the last tool output).
The agent loop puts its record of the calls in extra_info["tool_calls"] ({name, arguments,
status}); without it (a single-turn rollout) the calls are parsed from the text.
"""
from __future__ import annotations

import re

from megarl.rollout.multiturn.parser import parse_tool_calls

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def has_correct_tool_call(response: str, tool: str = "calculator", records: list | None = None) -> bool:
    """A call of `tool` that ran (per the loop's records) or that parses (from the text alone)."""
    if records is not None:
        return any(r.get("name") == tool and r.get("status") == "ok" for r in records)
    return any(c.name == tool and c.error is None for c in parse_tool_calls(response))


def final_answer(response: str) -> str | None:
    tail = re.split(r"</tool_response>|</tool_call>", response)[-1]
    numbers = _NUMBER.findall(tail)
    return numbers[-1] if numbers else None


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, tool: str = "calculator",
                  tool_weight: float = 0.5) -> dict:
    records = extra_info.get("tool_calls") if isinstance(extra_info, dict) else None
    called = has_correct_tool_call(solution_str, tool, records)
    answer = final_answer(solution_str)
    try:
        correct = answer is not None and float(answer) == float(ground_truth)
    except (TypeError, ValueError):
        correct = answer is not None and answer == str(ground_truth).strip()
    return {"score": tool_weight * called + (1.0 - tool_weight) * correct, "tool_called": called, "acc": correct}
