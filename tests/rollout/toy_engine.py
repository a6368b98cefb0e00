"""A rollout engine written from the contract alone: the three abstract methods of
megarl/rollout/base.py's RolloutEngine, a constructor and a builder, nothing else. It samples from
transformers' model of the checkpoint one token at a time (no KV cache, no batching).

Importing this module declares it as `actor_rollout_ref.rollout.name=toy`; a training run imports it
through `actor_rollout_ref.model.external_lib=tests.rollout.toy_engine` (tests/rollout/test_contract.py).
"""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megarl.engines import EngineInfo, register
from megarl.rollout.base import Completion, RolloutEngine, SamplingParams
from megarl.rollout.build_args import BuildRequest


class ToyEngine(RolloutEngine):
    def __init__(self, model_path: str):
        # Random weights, as rollout.load_format=dummy asks: the trainer's first sync brings its own.
        config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
        self.staged: dict[str, torch.Tensor] = {}

    def update_weights(self, bucket) -> None:
        for name, tensor in bucket:
            self.staged[name] = tensor.detach().to(torch.float32, copy=True)   # the sender reuses its buffer

    def finalize_weights(self) -> None:
        staged, self.staged = self.staged, {}
        missing = sorted(set(self.model.state_dict()) - set(staged))
        if missing:
            raise ValueError(f"toy engine: {len(missing)} tensors never arrived (first: {missing[0]})")
        self.model.load_state_dict(staged, strict=True)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        if sampling.top_k != -1 or sampling.top_p < 1 or sampling.repetition_penalty != 1:
            raise ValueError("toy engine: samples the whole distribution; leave top_k, top_p and "
                             "repetition_penalty at their defaults")
        gen = torch.Generator().manual_seed(sampling.seed or 0)
        groups = []
        for prompt in prompts:
            group = []
            for _ in range(sampling.n):
                ids, log_probs, reason = list(prompt), [], "length"
                for _ in range(sampling.max_tokens):
                    logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits / sampling.logprob_temperature, -1)   # megarl's convention
                    token = int(logp.argmax()) if sampling.greedy else int(torch.multinomial(logp.exp(), 1,
                                                                                            generator=gen))
                    ids.append(token)
                    log_probs.append(float(logp[token]))
                    if token in sampling.stop_ids:
                        reason = "stop"
                        break
                group.append(Completion(ids[len(prompt):], log_probs, reason))
            groups.append(group)
        return groups


def build_toy(request: BuildRequest) -> ToyEngine:
    return ToyEngine(request.model_path)


register(EngineInfo(name="toy", summary="a test engine written from the contract", build=f"{__name__}:build_toy"))
