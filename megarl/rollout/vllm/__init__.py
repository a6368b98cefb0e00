"""vLLM's offline LLM as a rollout engine (`actor_rollout_ref.rollout.name=vllm`), CPU build 0.32.0.

    engine.py      VLLMEngine: megarl's rollout contract on one in-process LLM per rollout rank
    args.py        the environment, verl's keys -> LLM arguments (or a one-line refusal), SamplingParams
    worker.py      what runs inside vLLM's worker: one reload per weight sync

What vLLM shares with TensorRT-LLM (log-prob mode, budgets, completions) is megarl/rollout/llm_api.py.
Nothing here imports vllm at import time: it loads when an engine is built.
"""
