"""Small random HF checkpoints built locally (tests, benchmarks, CPU runs; no hub access needed).

    python -m megarl.models.tiny /tmp/tiny-qwen2 --family qwen2 --vocab 301 --hidden 64 --layers 4
    python -m megarl.models.tiny /tmp/tiny-moe --family qwen3_moe --experts 4 --topk 2

writes config.json, model.safetensors and a word-level tokenizer (tokenizer.json) that
transformers' AutoTokenizer loads.
"""
from __future__ import annotations

import argparse
import os

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megarl.models import families


def token_rows(plen: torch.Tensor, rlen: torch.Tensor, R: int, vocab: int, g: torch.Generator,
               pad: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded prompt + response rows of random token ids (3..vocab-1) of the given lengths,
    as a rollout batch carries them: input_ids [B, longest + pad], responses [B, R],
    response_mask, prompt_lens, response_lens. Tokens are drawn row by row from `g`."""
    B = len(plen)
    ids = torch.zeros(B, int((plen + rlen).max()) + pad, dtype=torch.long)
    resp = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        toks = torch.randint(3, vocab, (int(plen[i] + rlen[i]),), generator=g)
        ids[i, :len(toks)] = toks
        resp[i, :rlen[i]] = toks[plen[i]:]
    mask = (torch.arange(R)[None] < rlen[:, None]).float()
    return {"input_ids": ids, "prompt_lens": plen, "response_lens": rlen, "responses": resp, "response_mask": mask}


SHAPES = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)

def make_tokenizer(path: str, vocab_size: int) -> None:
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = specials + [f"w{i}" for i in range(vocab_size - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(path)


def make_tiny_hf(path: str, family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32,
                 score_head: bool = False, tokenizer: bool = True, **overrides) -> str:
    """Save a random-init model of a registered `family` (its `tiny` config keys over SHAPES;
    `score_head`: its *ForSequenceClassification, 1 label). MoE routers get weights large enough
    that the top-k choice is clear-cut, so parity checks do not flip an expert on a 1e-7 difference."""
    fam = families.get(family)
    kwargs = {**SHAPES, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
              **fam.tiny, **overrides}
    # Some configs (Qwen3's) default head_dim to 128 whatever the hidden size.
    kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if score_head:
        kwargs["num_labels"] = 1
    cfg = tf.AutoConfig.for_model(fam.model_type, **kwargs)
    want = "score" if score_head else "lm"
    name = next((a for a, head in fam.architectures.items() if head == want), None)
    if name is None:
        raise ValueError(f"model family {family!r} has no {want} architecture")
    torch.manual_seed(seed)
    model = getattr(tf, name)(cfg)
    with torch.no_grad():  # random norms and biases too, so the maps of those tensors get tested
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):         # MoE router
                p.copy_(0.5 * torch.randn_like(p))
            elif n.endswith("bias") or n.startswith("score"):
                p.copy_(0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    if tokenizer:
        make_tokenizer(path, cfg.vocab_size)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--family", default="qwen2", choices=families.names())
    ap.add_argument("--experts", type=int, default=None, help="MoE families: number of experts")
    ap.add_argument("--topk", type=int, default=None, help="MoE families: experts per token")
    ap.add_argument("--vocab", type=int, default=SHAPES["vocab_size"])
    ap.add_argument("--hidden", type=int, default=SHAPES["hidden_size"])
    ap.add_argument("--ffn", type=int, default=SHAPES["intermediate_size"])
    ap.add_argument("--layers", type=int, default=SHAPES["num_hidden_layers"])
    ap.add_argument("--heads", type=int, default=SHAPES["num_attention_heads"])
    ap.add_argument("--kv-heads", type=int, default=SHAPES["num_key_value_heads"])
    ap.add_argument("--tie", action="store_true")
    a = ap.parse_args()
    moe = {k: v for k, v in (("num_experts", a.experts), ("num_experts_per_tok", a.topk)) if v is not None}
    make_tiny_hf(os.path.abspath(a.path), a.family, vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                 num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 tie_word_embeddings=a.tie, **moe)
    print(a.path)


if __name__ == "__main__":
    main()
