"""The CPU quickstart's task: multi-digit addition with a small locally built Qwen2 model.

    task.py       problem generator and the shipped data files (data/addition/*.jsonl)
    model.py      character tokenizer and Qwen2 config
    warmstart.py  supervised warm start and held-out accuracy
    checkpoint.py `bootstrap(model_dir, **kwargs)`: all of the above into an HF checkpoint directory
"""
from megarl.examples.addition.checkpoint import bootstrap

__all__ = ["bootstrap"]
