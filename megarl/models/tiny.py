"""Small random HF checkpoints built locally (tests, benchmarks, CPU runs; no hub access needed).

    python -m megarl.models.tiny /tmp/tiny-qwen2 --family qwen2 --vocab 301 --hidden 64 --layers 4
    python -m megarl.models.tiny /tmp/tiny-moe --family qwen3_moe --experts 4 --topk 2

writes config.json, model.safetensors and a word-level tokenizer (tokenizer.json) that
transformers' AutoTokenizer loads. The config comes from the family's own description
(ModelFamily.tiny_config); transformers builds the model where it knows the model_type, else the
tensors megarl's map expects are drawn here, so a family of megarl's own still gets a checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import transformers as tf
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megarl.models import families
from megarl.models.convert import hf_shapes
from megarl.models.families.base import TINY_SHAPES
from megarl.models.spec import ModelSpec


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


SHAPES = TINY_SHAPES

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
    cfg = fam.tiny_config(score_head, **overrides)
    torch.manual_seed(seed)
    if fam.model_type in tf.CONFIG_MAPPING:
        keys = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
        model = getattr(tf, cfg["architectures"][0])(tf.AutoConfig.for_model(fam.model_type, **keys))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(_draw(n, p))
        model.to(dtype).save_pretrained(path)
    else:
        _save_described(path, cfg, dtype)
    if tokenizer:
        make_tokenizer(path, cfg["vocab_size"])
    return path


def _draw(name: str, p: torch.Tensor) -> torch.Tensor:
    """Random norms and biases too, so the maps of those tensors get tested."""
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn_like(p)
    if name.endswith("mlp.gate.weight"):         # MoE router
        return 0.5 * torch.randn_like(p)
    if name.endswith("bias") or name.startswith("score"):
        return 0.05 * torch.randn_like(p)
    return p


def _save_described(path: str, cfg: dict, dtype: torch.dtype) -> None:
    """A model_type transformers does not know: every tensor megarl's map expects for the config
    (convert.hf_shapes), drawn as transformers would (normal, std 0.02) and then as _draw says."""
    spec = ModelSpec.from_hf_config(cfg)
    tensors = {}
    for name, shape in hf_shapes(spec, "value" if spec.head == "score" else "lm").items():
        tensors[name] = _draw(name, 0.02 * torch.randn(shape)).to(dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        # what ModelSpec and the built-in engine assume when a key is absent, written out
        defaults = {"hidden_act": "silu", "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}
        json.dump({**defaults, **cfg, "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)


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
