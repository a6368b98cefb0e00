"""The CPU quickstart's task: multi-digit addition with a small locally built Qwen2 model.

    task.py       problem generator and the shipped data files (data/addition/*.jsonl)
    model.py      character tokenizer and Qwen2 config
    warmstart.py  supervised warm start and held-out accuracy
    checkpoint.py `bootstrap(model_dir, **kwargs)`: all of the above into an HF checkpoint directory
"""


def bootstrap(model_dir: str, config=None, **kwargs) -> str:
    """`actor_rollout_ref.model.bootstrap: megarl.examples.addition:bootstrap` (see checkpoint.py)."""
    from megarl.examples.addition.checkpoint import bootstrap as build  # lazy: configs name this package
    return build(model_dir, config, **kwargs)


__all__ = ["bootstrap"]
