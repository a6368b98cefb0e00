"""The conformance fake's SamplingParams, CompletionOutput and sampling step (see trtllm_fake.py).

FAKE: built from the snapshot's fields and rules; each rule names its source in the snapshot's
"fields" or beside it here.
"""
from __future__ import annotations

import dataclasses
import os

import torch

DEFAULTS = {"max_tokens": 32, "n": 1, "include_stop_str_in_output": False, "detokenize": True,
            "use_beam_search": False, "logprobs_simple_format": False, "prompt_logprobs_simple_format": False,
            "exclude_input_from_output": True, "add_special_tokens": True, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "ignore_eos": False, "apply_batched_logits_processor": False,
            "return_context_logits": False, "return_generation_logits": False, "return_encoder_output": False,
            "return_perf_metrics": False, "return_routed_experts": False}


def _coerce_logprobs(value, rules: dict):
    """1.2: `logprobs and int(logprobs)` (True->1, False stays False); 1.3: True->0, False->None."""
    if value is True:
        return rules["logprobs_true_is"]
    if value is False:
        return rules["logprobs_false_is"]
    return value and int(value) if rules["logprobs_true_is"] == 1 else (None if value is None else int(value))


def _validate_logprobs(sp, rules: dict, modes) -> None:
    sp.logprobs = _coerce_logprobs(sp.logprobs, rules)
    sp.prompt_logprobs = _coerce_logprobs(sp.prompt_logprobs, rules)
    limit = rules.get("logprobs_max")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        # check_logprobs_limit (executor/params/sampling.py at 1f064c46), messages verbatim
        if limit is not None and value is not None and value < 0:
            raise ValueError(f"{name} must be positive, zero or None")
        if limit is not None and value is not None and value > limit:
            raise ValueError(f"{name} must be less than or equal to {limit}")
    if rules.get("simple_format_needs_logprobs") is not None:
        for flag, name in (("logprobs_simple_format", "logprobs"),
                           ("prompt_logprobs_simple_format", "prompt_logprobs")):
            if getattr(sp, flag) and getattr(sp, name) != 0:
                raise ValueError(f"{flag}=True requires {name} == 0 (the sampled token only), "
                                 f"got {name}={getattr(sp, name)}")
        if rules.get("simple_format_no_beam_search") and sp.logprobs_simple_format and sp.use_beam_search:
            raise ValueError("logprobs_simple_format=True is not supported with beam search")
    if modes is not None:
        if sp.logprobs_mode is None:
            sp.logprobs_mode = rules["logprobs_mode_default"]
        if str(getattr(sp.logprobs_mode, "value", sp.logprobs_mode)) not in modes:
            raise ValueError(f"logprobs_mode must be one of {modes}, got {sp.logprobs_mode!r}")


def sampling_params_class(snap: dict):
    modes, rules = snap.get("logprobs_modes"), snap["sampling_rules"]

    def __post_init__(self):
        self.best_of = self.best_of or self.n
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        greedy = not self.use_beam_search and (
            (self.temperature is None and self.top_p is None and self.top_k is None)
            or self.top_k == 1 or self.top_p == 0.0 or self.temperature == 0)
        if self.best_of > 1 and greedy and not os.environ.get(snap.get("greedy_n_env", "TLLM_ALLOW_N_GREEDY_DECODING")):
            raise ValueError(f"Greedy decoding in the LLM API does not allow multiple returns. Please set to "
                             f"best_of=1, got best_of={self.best_of}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        _validate_logprobs(self, rules, modes)

    fields = [(f, object, dataclasses.field(default=DEFAULTS.get(f))) for f in snap["sampling_params_fields"]]
    return dataclasses.make_dataclass("SamplingParams", fields, kw_only=True,
                                      namespace={"__post_init__": __post_init__})


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None


def completion_class(snap: dict):
    fields = [(f, object, dataclasses.field(default=None)) for f in snap["completion_output_fields"]]
    return dataclasses.make_dataclass("CompletionOutput", fields)


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list
    finished: bool = True


# Before PR #17172 (merged 2026-08-04) TorchSampler ignored SamplingParams.seed: every request drew
# from the sampler's one generator, so the same seed did not repeat a sample. After it each request
# has a generator seeded from its own seed (the PR's title: "Support per-request seed in
# TorchSampler"; its code was not readable here, so the fake seeds a request's generator with the
# seed alone and gives sample j of a request its own draw). snapshot["seed_semantics"].
_SHARED = torch.Generator().manual_seed(12345)


def generator(snap: dict, seed, sample_index: int) -> torch.Generator:
    if snap.get("seed_semantics") == "per_request":
        return torch.Generator().manual_seed(((seed or 0) * 1000 + sample_index) & ((1 << 63) - 1))
    return _SHARED


def step(logits, seen, sp, gen):
    """One token: (token, raw log-probs, processed log-probs) as TorchSampler computes them."""
    raw = torch.log_softmax(logits, -1)
    proc = logits.clone()
    if sp.repetition_penalty not in (None, 1.0):
        ids = torch.tensor(sorted(set(seen)))
        vals = proc[ids]
        proc[ids] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if sp.temperature in (None, 0) or sp.top_k == 1:
        return int(proc.argmax()), raw, torch.log_softmax(proc, -1)
    proc = proc / sp.temperature
    if sp.top_k:
        kth = proc.topk(sp.top_k).values[-1]
        proc[proc < kth] = float("-inf")
    if sp.top_p is not None and sp.top_p < 1:
        order = proc.argsort(descending=True)
        probs = torch.softmax(proc[order], -1)
        proc[order[(probs.cumsum(-1) - probs) > sp.top_p]] = float("-inf")
    processed = torch.log_softmax(proc, -1)
    return int(torch.multinomial(processed.exp(), 1, generator=gen)), raw, processed


def logprobs_entry(snap: dict, tok, raw, processed, sp):
    if sp.logprobs is None or sp.logprobs is False:
        return None
    if snap.get("logprobs_modes") is None:
        # 1.2: the top-K only; the sampled token is there only when it ranks in the top K.
        top = raw.topk(sp.logprobs)
        return {int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(top.values, top.indices))}
    values = processed if str(getattr(sp.logprobs_mode, "value", sp.logprobs_mode)) == "processed" else raw
    if sp.logprobs_simple_format:
        return float(values[tok])
    out = {tok: Logprob(float(values[tok]), int((values > values[tok]).sum()) + 1)}
    if sp.logprobs:                       # 1.3: the sampled token plus the top K
        top = values.topk(sp.logprobs)
        for r, (v, t) in enumerate(zip(top.values, top.indices)):
            out.setdefault(int(t), Logprob(float(v), r + 1))
    return out


def routes_for(tokens: list[int], layers: int, top_k: int, experts: int) -> torch.Tensor:
    """Routed experts as PR #18397 returns them: [fed positions, MoE layers, top-k] ids, one row per
    token the model was fed (prompt + every sampled token but the last). The fake's model is dense,
    so the ids are a fixed function of the token and layer: what is checked is the shape, the
    alignment with the tokens and that megarl passes them on unchanged."""
    t = torch.tensor(tokens, dtype=torch.long)[:, None, None]
    lk = torch.arange(layers)[None, :, None] * 7 + torch.arange(top_k)[None, None, :]
    return ((t * 31 + lk) % experts).to(torch.int16)
