"""A tool-use task small enough for CPU: "Q: 3+4" -> a calculator call -> "A: 7".

    model.py     character tokenizer, tiny Qwen2, SFT on the format, bootstrap(), the data rows
    reward.py    compute_score: the right tool called, the right final answer
    tools.yaml   verl's rollout-guide tools (calculator built in, search without implementation) + my_tools.py
"""


def bootstrap(model_dir: str, config=None, **kwargs) -> str:
    """`actor_rollout_ref.model.bootstrap: megarl.examples.tool_use:bootstrap` (see model.py)."""
    from megarl.examples.tool_use.model import bootstrap as build  # lazy: configs name this package
    return build(model_dir, config, **kwargs)


__all__ = ["bootstrap"]
