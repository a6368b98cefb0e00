"""What the LLM-API engines (vLLM, TensorRT-LLM) share behind megarl's rollout contract.

Both take token-id prompts and a per-request sampling object, report a log-prob per sampled token
in one of two library modes, stop on token ids, and keep a prefix cache that must be forgotten
when the weights change. Where the two libraries agree, the rule lives here once, so what vLLM
proves in CI (tests/rollout/vllm_checks.py) stands behind TensorRT-LLM's adapter too:

    logprob_mode(sp, engine)          -> "raw" | "processed": the library mode equal to megarl's convention
    response_budget(sp, prompt_len, max_len)   max_tokens that fits the engine's context
    completion_from_output(output, engine)     a library CompletionOutput -> Completion (sampled-token log-probs)
    copy_greedy(groups, n)            greedy asks the library for one sample and copies it n times
    prompt_seed(seed, index)          one seed per prompt of a call (both seed each request's generator)

Each library's own argument names stay in its package (rollout/vllm/, rollout/trtllm/).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megarl.config.errors import ConfigError
from megarl.rollout.base import Completion, SamplingParams
from megarl.rollout.sampling import step_seed

KEY = "actor_rollout_ref.rollout"


def logprob_mode(sp: SamplingParams, engine: str = "TensorRT-LLM") -> str:
    """Which library log-prob equals the trainer's log_softmax(logits / T) of the sampled token.

    Both libraries offer "raw" (log_softmax of the model's logits, before penalties and temperature)
    and "processed" (after penalties, temperature and the top-k/top-p mask, renormalised over what
    the mask keeps). Raw is exact when T is 1 (greedy counts as T=1); processed is exact when only
    temperature applies; temperature mixed with a mask or a penalty has no exact mode: refused."""
    if sp.greedy or sp.temperature == 1.0:
        return "raw"
    if sp.top_k == -1 and sp.top_p == 1.0 and sp.repetition_penalty == 1.0:
        return "processed"
    raise ConfigError(f"temperature={sp.temperature} together with top_k={sp.top_k}/top_p={sp.top_p}/"
                      f"repetition_penalty={sp.repetition_penalty}: {engine} reports log-probs before temperature "
                      "(raw) or after top-k/top-p and penalties (processed), never the trainer's "
                      "log_softmax(logits/T); "
                      "set temperature=1.0, or drop top_k/top_p/repetition_penalty, or use rollout.name=native",
                      f"{KEY}.temperature")


def response_budget(sp: SamplingParams, prompt_len: int, max_len: int | None) -> int:
    """max_tokens = min(response budget, room left in max_model_len after the prompt)."""
    room = sp.max_tokens if max_len is None else min(sp.max_tokens, max_len - prompt_len)
    if room < 1:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no room in max_model_len={max_len}; "
                         "raise max_model_len or shorten the prompt (prompt_length / prompt_truncation=left)")
    return room


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def completion_from_output(output: Any, engine: str = "TensorRT-LLM") -> Completion:
    """One CompletionOutput (token_ids, logprobs, finish_reason) -> Completion with the *sampled*
    token's log-probs, read from the simple format (one float per token) or the dict format
    ({token id: Logprob}, what vLLM returns for logprobs=0)."""
    tokens = [int(t) for t in output.token_ids]
    per_token = output.logprobs or []
    if len(per_token) != len(tokens):
        raise RuntimeError(f"{engine} returned {len(per_token)} log-prob entries for {len(tokens)} tokens")
    logps = []
    for pos, (tok, entry) in enumerate(zip(tokens, per_token)):
        if isinstance(entry, dict):
            if tok not in entry:          # never take another entry of the dict
                raise RuntimeError(f"{engine} log-probs at position {pos} lack the sampled token {tok} "
                                   f"(entries for {sorted(entry)[:5]})")
            logps.append(_logprob_value(entry[tok]))
        else:
            logps.append(float(entry))
    reason = {"stop": "stop", "length": "length"}.get(str(output.finish_reason), "abort")
    return Completion(tokens, logps, reason)


def copy_greedy(groups: list[list[Completion]], sp: SamplingParams) -> list[list[Completion]]:
    """Greedy samples are identical, so the library is asked for one (TensorRT-LLM refuses greedy
    n>1, vLLM would decode the same tokens n times) and it is copied to n."""
    if not (sp.greedy and sp.n > 1):
        return groups
    return [[dataclasses.replace(g[0], token_ids=list(g[0].token_ids), log_probs=list(g[0].log_probs))
             for _ in range(sp.n)] for g in groups]


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of prompt `index` of a call. Both libraries seed a request's generator from its own
    seed (vLLM 0.32.0: each of the n samples from seed + its index; TensorRT-LLM after PR #17172),
    so one seed for every prompt of a call gives equal prompts equal samples and draws every
    prompt's tokens from the same random numbers. One seed per prompt keeps the call reproducible."""
    return None if seed is None else step_seed(seed, index)
