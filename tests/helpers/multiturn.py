"""Shared pieces of the multi-turn tests: a scripted stand-in engine and prompt batches."""
from __future__ import annotations

import numpy as np

from megarl.protocol import DataProto
from megarl.rollout.base import Completion, RolloutEngine, SamplingParams


def fake_log_prob(token: int) -> float:
    return -(token + 1) / 1000.0


class ScriptedEngine(RolloutEngine):
    """A FAKE engine (no model) for the loop's control flow: `script(context_text, sample_index)`
    gives the next turn's text for a context. It honours stop ids, EOS and max_tokens as a real
    engine does, and reports the made-up log-prob -(token + 1) / 1000 for every token so the tests
    can check where the loop puts model tokens. The log-prob contract itself is tested against the
    real native engine and transformers (tests/test_multiturn_engine.py)."""

    def __init__(self, tokenizer, script):
        self.tok, self.script = tokenizer, script
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        self.calls.append((len(prompts), sampling))
        out = []
        for p in prompts:
            context = self.tok.decode(p, skip_special_tokens=False)
            group = []
            for j in range(sampling.n):
                ids = self.tok.encode(self.script(context, j), add_special_tokens=False)
                end = next((k + 1 for k, t in enumerate(ids) if t in sampling.stop_ids), None)
                reason = "stop"
                if end is None:
                    end, reason = len(ids), "length" if len(ids) >= sampling.max_tokens else "stop"
                if end > sampling.max_tokens:
                    end, reason = sampling.max_tokens, "length"
                ids = ids[:end]
                group.append(Completion(ids, [fake_log_prob(t) for t in ids], reason))
            out.append(group)
        return out

    def update_weights(self, bucket) -> None:
        pass

    def finalize_weights(self) -> None:
        pass


def prompt_batch(tokenizer, texts: list[str], truths: list[str], sampling: SamplingParams,
                 extra: list[dict] | None = None) -> DataProto:
    ids = np.empty(len(texts), dtype=object)
    for i, t in enumerate(texts):
        ids[i] = tokenizer.encode(t, add_special_tokens=False)
    return DataProto.from_dict(non_tensors={
        "prompt_token_ids": ids, "raw_prompt": list(texts), "data_source": ["tool_use"] * len(texts),
        "reward_model": [{"ground_truth": g} for g in truths],
        "extra_info": extra if extra is not None else [{"index": i} for i in range(len(texts))]},
        meta_info={"sampling": sampling, "pad_token_id": tokenizer.pad_token_id})


def rows(out: DataProto, tokenizer) -> list[dict]:
    """Per row: response text, model-token text, the mask and log-probs, finish reason."""
    res = []
    for i in range(len(out)):
        n = int(out.batch["response_lens"][i])
        ids = out.batch["responses"][i, :n].tolist()
        mask = out.batch["response_mask"][i, :n].tolist()
        res.append({"ids": ids, "mask": mask, "text": tokenizer.decode(ids, skip_special_tokens=False),
                    "log_probs": out.batch["rollout_log_probs"][i, :n].tolist(),
                    "tool_text": tokenizer.decode([t for t, m in zip(ids, mask) if m == 0], skip_special_tokens=False),
                    "finish": out.non_tensor_batch["finish_reasons"][i],
                    "calls": out.non_tensor_batch["tool_calls"][i]})
    return res
