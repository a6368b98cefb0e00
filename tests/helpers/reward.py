"""Shared builders for the reward tests: rolled-out batches in megarl/protocol.py's layout."""
import numpy as np
import torch

from megarl.examples.addition.model import build_tokenizer
from megarl.protocol import DataProto

_TOK = {}


def tokenizer():
    """The quickstart's character tokenizer (digits, +, =, space)."""
    if "digits" not in _TOK:
        _TOK["digits"] = build_tokenizer()
    return _TOK["digits"]


def text_tokenizer():
    """A character tokenizer over printable ASCII, for free-text responses."""
    if "text" not in _TOK:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", "\n"] + [chr(c) for c in range(32, 127)])}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        core.decoder = decoders.Fuse()
        core.add_special_tokens(["<pad>", "<eos>", "<unk>"])
        _TOK["text"] = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    return _TOK["text"]


def rollout_batch(responses: list[str], truths: list[str], source: str = "addition", width: int = 8,
                  eos: bool = True, tok=None) -> DataProto:
    """Right-padded responses (+EOS) with response_mask/lens, as the rollout packs them."""
    tok = tok or tokenizer()
    B = len(responses)
    ids = torch.full((B, width), tok.pad_token_id)
    mask = torch.zeros(B, width, dtype=torch.long)
    lens = []
    for i, text in enumerate(responses):
        r = tok.encode(text)[:width - 1] + ([tok.eos_token_id] if eos else [])
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
        lens.append(len(r))
    return DataProto.from_dict(
        {"responses": ids, "response_mask": mask, "response_lens": torch.tensor(lens)},
        {"data_source": np.array([source] * B, dtype=object),
         "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object),
         "extra_info": np.array([{"index": i} for i in range(B)], dtype=object),
         "prompt_token_ids": np.array([tok.encode("1+1=")] * B, dtype=object),
         "uid": np.array([f"u{i // 2}" for i in range(B)], dtype=object)})
