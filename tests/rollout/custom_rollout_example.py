"""A user's rollout class in the form verl's inference guide gives (`generate_sequences(batch)`), built on
transformers' generate. Loaded by the tests through rollout.custom_cls_path / custom_cls_name.

It returns `responses` as strings and `log_probs` as a right-padded tensor, as the seed does;
megarl re-tokenizes the strings and checks the lengths.
"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from megarl.rollout.base import BaseRollout


class CustomRollout(BaseRollout):
    def __init__(self, config, role, model_path=None, tokenizer_path=None):
        super().__init__(config, role)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        self.params = dict(self.model.named_parameters())
        self.pending = None

    def generate_sequences(self, batch):
        sampling = batch.meta_info["sampling"]
        n = sampling.n
        reps = 1 if sampling.greedy else n
        responses, log_probs = [], []
        for index, prompt in enumerate(batch.prompt_token_ids):
            gen = GenerationConfig(max_new_tokens=sampling.max_tokens, num_return_sequences=reps,
                                   do_sample=not sampling.greedy, eos_token_id=sorted(sampling.stop_ids) or None,
                                   pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                   temperature=None if sampling.greedy else sampling.temperature,
                                   top_k=None if sampling.greedy or sampling.top_k == -1 else sampling.top_k,
                                   top_p=None if sampling.greedy else sampling.top_p)
            with torch.random.fork_rng():
                torch.manual_seed((sampling.seed or 0) * 1_000_003 + index)   # a stream per prompt
                out = self.model.generate(torch.tensor([list(prompt)]), generation_config=gen)
            tokens = out.sequences[:, len(prompt):]
            logits = torch.stack(out.logits, 1).float() / sampling.logprob_temperature
            lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
            for row in [0] * n if reps == 1 else range(n):
                toks = tokens[row].tolist()
                end = next((k + 1 for k, t in enumerate(toks) if t in sampling.stop_ids), len(toks))
                responses.append(self.tokenizer.decode(toks[:end]))
                log_probs.append(torch.nn.functional.pad(lp[row, :end], (0, sampling.max_tokens - end)))
        output_batch = batch.repeat(n, interleave=True) if n > 1 else batch.clone()
        output_batch.responses = responses
        output_batch.log_probs = torch.stack(log_probs)
        output_batch.response_lengths = torch.tensor([len(r) for r in responses])
        return output_batch

    def update_weights(self, bucket):
        self.pending = self.pending or {}
        self.pending.update({name: t for name, t in bucket})

    def finalize_weights(self):
        missing = sorted(set(self.params) - set(self.pending or {}))
        if missing:
            self.pending = None
            raise ValueError(f"missing tensors: {missing[:3]}")
        with torch.no_grad():
            for name, t in self.pending.items():
                self.params[name].copy_(t)
        self.pending = None

    def abort_weight_update(self):
        self.pending = None
