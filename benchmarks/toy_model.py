"""A small Qwen2-style model and a BPE tokenizer built locally (no hub access), for benchmarks.

    python benchmarks/toy_model.py /tmp/toy          # writes config.json, weights, tokenizer.json
    python benchmarks/toy_model.py /tmp/toy --smoke  # CI: a 512-token tokenizer and a 2-layer model

The tokenizer is trained on this Python's own standard-library sources (deterministic for a
given Python), the model is randomly initialised with a fixed seed.
"""
from __future__ import annotations

import glob
import os
import sysconfig

import torch


def corpus(max_files: int = 120) -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    return [open(f, encoding="utf-8", errors="replace").read() for f in files]


def build_tokenizer(out_dir: str, vocab_size: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(120 if vocab_size >= 4096 else 10), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, vocab_size: int, *, hidden: int = 384, layers: int = 10, heads: int = 6,
                kv_heads: int = 2, intermediate: int = 1152, eos_token_id: int = 0, pad_token_id: int = 1,
                seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                      tie_word_embeddings=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                      max_position_embeddings=4096)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(out_dir)
    return model


def build(out_dir: str, vocab_size: int = 8192, **model_kwargs):
    """Tokenizer + model in `out_dir` (reused when already there); returns (tokenizer, n_params)."""
    from transformers import AutoTokenizer

    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        build_tokenizer(out_dir, vocab_size)
    tok = AutoTokenizer.from_pretrained(out_dir)
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        build_model(out_dir, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **model_kwargs)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(out_dir)
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    n_params = V * h + L * (h * (2 * h + 2 * kv) + 2 * kv + h + 3 * h * i + 2 * h) + h
    return tok, n_params


SMOKE = dict(vocab_size=512, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)   # --smoke (CI)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="/tmp/megarl_toy")
    ap.add_argument("--smoke", action="store_true", help=f"CI's shape: {SMOKE}")
    a = ap.parse_args()
    tok, n = build(a.out, **(SMOKE if a.smoke else {}))
    print(f"tokenizer: {len(tok)} tokens; model: {n / 1e6:.2f}M parameters")
