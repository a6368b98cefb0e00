"""The quickstart's character-level tokenizer and small Qwen2 model, built locally.

Nothing is downloaded: the tokenizer is a `tokenizers` word-level model over single characters,
saved as a transformers `PreTrainedTokenizerFast`; the model is `Qwen2ForCausalLM` with random
weights from a fixed seed. Head counts are even so that TP=2 (and the rollout's TP=2) can shard.
"""
from __future__ import annotations

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+= ")
# The tokenizer's own chat template renders messages as their plain text, so a verl-format row
# (`prompt: [{role: user, content: "12+3="}]`) becomes exactly "12+3=" with no role markers.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

MODEL_DEFAULTS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)


def build_tokenizer():
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()                                              # decode without spaces
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>", model_max_length=MODEL_DEFAULTS["max_position_embeddings"])
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    return tok


# family="qwen3_moe": the same trunk with a Qwen3-MoE MLP (4 experts, top-2, as configs/grpo_moe_tiny.yaml uses).
MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True,
                    router_aux_loss_coef=0.01, head_dim=32)


def build_model(tokenizer, seed: int = 0, family: str = "qwen2", **overrides):
    """A randomly initialised Qwen2ForCausalLM (or Qwen3MoeForCausalLM, fp32) sized by
    MODEL_DEFAULTS plus `overrides`."""

    if family not in ("qwen2", "qwen3_moe"):
        raise ValueError(f"family={family!r}: the addition model is built as qwen2 or qwen3_moe")
    shape = {**MODEL_DEFAULTS, **(MOE_DEFAULTS if family == "qwen3_moe" else {}), **overrides}
    prefix = "Qwen2" if family == "qwen2" else "Qwen3Moe"
    config = getattr(transformers, prefix + "Config")(
        vocab_size=len(tokenizer), tie_word_embeddings=False, rope_theta=10000.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32", **shape)
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + "ForCausalLM")(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
