"""Tiny HF models and a word-level tokenizer, built locally for the rollout tests."""
from __future__ import annotations

import os

import torch

VOCAB = 96


def tiny_config(kind: str = "qwen2", **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, initializer_range=0.15, max_position_embeddings=512)
    base.update(overrides)
    return {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[kind](**base)


def make_model(cfg, seed: int):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def save_model(out_dir: str, kind: str = "qwen2", seed: int = 0, **overrides):
    """An HF directory (config.json + safetensors); returns the model."""
    model = make_model(tiny_config(kind, **overrides), seed)
    model.save_pretrained(out_dir)
    return model


def save_tokenizer(out_dir: str, size: int = VOCAB):
    """In a directory of its own: transformers 5 picks a tokenizer class from a config.json's
    model_type and would swap in that class's decoder. Word-level: token i is the word "w{i:02d}",
so text and ids round-trip exactly (fixed width,
    so the special tokens w00 / w01 never match inside another word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i:02d}": i for i in range(size)}     # size: a model's vocab_size, for --check's size check
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w00"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w01", pad_token="w00")
    fast.save_pretrained(out_dir)
    return fast


def state_of(model) -> list[tuple[str, torch.Tensor]]:
    """The HF-named full tensors a weight sync streams (tied duplicates once)."""
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def in_buckets(named, count: int):
    size = -(-len(named) // count)
    return [named[i:i + size] for i in range(0, len(named), size)]


def model_dirs(root: str, **overrides) -> dict:
    """Weights A (the engine's start) and B (a sync's new weights), same config; the tokenizer.
    `overrides`: config keys over tiny_config's (vLLM on CPU needs larger attention heads)."""
    a, b, tok = (os.path.join(root, k) for k in ("a", "b", "tok"))
    save_tokenizer(tok)
    return {"a": a, "b": b, "tok": tok, "model_a": save_model(a, seed=0, **overrides),
            "model_b": save_model(b, seed=1, **overrides)}


def trtllm_config(**kw):
    """The TensorRT-LLM adapter's tests' rollout config: short prompts and responses, weights loaded."""
    from megarl.rollout.config import RolloutConfig
    return RolloutConfig(**{"name": "trtllm", "load_format": "auto", "prompt_length": 16, "response_length": 12, **kw})


# The log-prob parity checks' prompts and sampling temperature, and a policy-gradient loss that moves
# every weight between syncs (tests/rollout/test_actor_logprob_match.py, tests/rollout/vllm_checks.py).
PARITY_PROMPTS = [[5, 17, 42, 8, 9], [55, 12], [11, 12, 13, 14, 15, 16, 17, 18], [200, 3, 4]]
PARITY_TEMPERATURE = 0.8


def policy_loss(out, mb):
    m = mb.batch["response_mask"].float()
    loss = -(out["log_probs"] * mb.batch["advantages"] * m).sum() / mb.meta_info["global_tokens"]
    return loss, {"actor/pg_loss": loss.detach()}


def require_vllm() -> None:
    """Skip where vllm does not import, except under CI=1 (.ci/run), where the README's test
    command installed it: there a missing vLLM fails, so CI always runs the vLLM tests for real."""
    import importlib.util

    import pytest
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed: CI runs the README's test command, which installs it")
        pytest.skip("vllm is not installed (README: Using vLLM)")
