"""transformers' `generate` behind the rollout contract (`rollout.name=hf`): the slow baseline.

    engine = HFEngine(model_dir, device="cpu")
    groups = engine.generate(prompts, SamplingParams(n=4, max_tokens=32, seed=0))

Prompts are left-padded into one batch and expanded n times (`num_return_sequences`); the raw
logits of every step (`output_logits=True`) give the log-probs of the sampled tokens under the
contract's convention, log_softmax(logits / temperature), before top-k/top-p and penalties.
One rank holds the whole model: this engine does not shard (rollout TP must be 1).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from megarl.config.errors import ConfigError
from megarl.models.hf_config import read_hf_config
from megarl.rollout.base import BaseRollout, Completion, SamplingParams, admit, rollout_dtype
from megarl.rollout.build_args import KEY, BuildRequest, engine_options, override_values, pad_id
from megarl.rollout.prompts import PromptGuard
from megarl.rollout.weight_state import WeightState


class HFEngine(BaseRollout):
    def __init__(self, model_dir: str, *, device: str | torch.device = "cpu", dtype: str = "auto",
                 prompt_length: int | None = None, prompt_truncation: str = "error", pad_token_id: int = 0,
                 load_format: str = "auto", config=None, hf_overrides: dict | None = None):
        super().__init__(config, role="rollout")

        self.device = torch.device(device)
        self.dtype = rollout_dtype(dtype, self.device)
        # model.override_config, as the trainer's model has it: from_pretrained's keyword arguments
        # replace whole attributes, so each is passed with its merged value (override_values).
        overrides = override_values(read_hf_config(model_dir), hf_overrides or {})
        cfg = AutoConfig.from_pretrained(model_dir, **overrides)
        if load_format == "dummy":              # weights come from the first sync
            model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        # A checkpoint's generation_config.json (top_k=50, its own EOS...) must not leak into rollout.
        self.model.generation_config = GenerationConfig()
        self.pad_token_id = pad_token_id
        self.tensors = self.model.state_dict(keep_vars=True)
        self.weights = WeightState([n for n, _ in self.model.named_parameters()], ready=load_format != "dummy")
        self.guard = PromptGuard(prompt_length, prompt_truncation, vocab_size=self.model.config.vocab_size)
        self.asleep = False

    # -- weights: HF names are this model's own names, copied in place ---------------------------
    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights.begin_bucket()
        for name, t in bucket:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in self.tensors:
                raise ValueError(f"weight update: unknown tensor {name!r} for {type(self.model).__name__}")
            dst = self.tensors[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"weight update: {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.data.copy_(t)
            self.weights.received(name)

    def finalize_weights(self) -> None:
        self.weights.finalize()

    def abort_weight_update(self) -> None:
        self.weights.abort()

    def sleep(self) -> None:
        """No KV cache survives a generate() call here; on GPU the weights move to host memory."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        self.asleep = False

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_limit: int | None = None) -> list[list[Completion]]:
        prompts = admit(self, prompts, sampling, prompt_limit)
        sp, P = sampling, max(map(len, prompts))
        ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        stops = sorted(sp.stop_ids)
        reps = 1 if sp.greedy else sp.n            # greedy samples are all alike: decode one, copy it
        gen = dict(max_new_tokens=sp.max_tokens, num_return_sequences=reps, eos_token_id=stops or None,
                   pad_token_id=self.pad_token_id, repetition_penalty=sp.repetition_penalty,
                   output_logits=True, return_dict_in_generate=True)
        if sp.greedy:
            gen.update(do_sample=False)
        else:
            gen.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p,
                       top_k=0 if sp.top_k == -1 else sp.top_k)
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ()).item())
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=GenerationConfig(**gen))
        tokens = out.sequences[:, P:].cpu()                                         # [B*n, R]
        logps = torch.stack([torch.log_softmax(lg.float() / sp.logprob_temperature, dim=-1)
                             .gather(-1, tokens[:, t:t + 1].to(lg.device)).squeeze(-1).cpu()
                             for t, lg in enumerate(out.logits)], dim=1)            # [B*n, R]
        stop_set = sp.stop_ids
        groups: list[list[Completion]] = []
        for i in range(len(prompts)):
            group = []
            for k in range(sp.n):
                row = i * reps + (k if reps > 1 else 0)
                toks = tokens[row].tolist()
                end = next((k + 1 for k, t in enumerate(toks) if t in stop_set), None)
                reason = "stop" if end is not None else "length"
                end = end or len(toks)
                group.append(Completion(toks[:end], logps[row, :end].tolist(), reason))
            groups.append(group)
        return groups


def build_hf(req: BuildRequest) -> HFEngine:
    """The engine from the rollout config (declared in megarl/engines/hf.py)."""
    cfg = req.cfg
    if cfg.tensor_model_parallel_size != 1:
        raise ConfigError("the hf engine holds one whole model per rank; set tensor_model_parallel_size=1 "
                          "or use rollout.name=native for TP", f"{KEY}.tensor_model_parallel_size")
    defaults = dict(dtype=cfg.dtype, prompt_length=cfg.prompt_length, prompt_truncation=cfg.prompt_truncation,
                    pad_token_id=pad_id(req.tokenizer), load_format=cfg.load_format)
    return HFEngine(req.model_path, device=req.device, config=cfg, hf_overrides=req.hf_overrides,
                    **engine_options(HFEngine, defaults, req.user_kwargs, cfg.name))
