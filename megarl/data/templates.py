"""Chat templates: the tokenizer's own, one of a few by name, or a Jinja string.

    data.chat_template: null | chatml | qwen | llama3 | alpaca | plain | "{% for m in messages %}..."

Rendering always goes through the tokenizer's `apply_chat_template` (transformers' sandboxed
Jinja), so a named template behaves exactly as if the tokenizer shipped it.
"""
from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.config.typed import closest

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2-Instruct: ChatML with a default system message when the conversation has none.
QWEN = ("{% if messages[0]['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        + CHATML)
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
ALPACA = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
          "{% elif m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
          "{% else %}### Response:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}### Response:\n{% endif %}")
# The messages' text only, one per line: for base models and synthetic tasks ("12+3=").
# (The newline is an expression: transformers renders with trim_blocks, which eats one after a tag.)
PLAIN = "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m['content'] }}{% endfor %}"

NAMED = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3, "alpaca": ALPACA, "plain": PLAIN}


def resolve_chat_template(name: str | None, tokenizer) -> str | None:
    """The Jinja text to render with: named, given inline, or the tokenizer's (None if it has none)."""
    if name is None:
        return getattr(tokenizer, "chat_template", None) or None
    if "{%" in name or "{{" in name:
        return name
    if name in NAMED:
        return NAMED[name]
    hint = closest(name, list(NAMED))
    raise ConfigError(f"unknown chat template {name!r}; " + (f"did you mean {hint!r}? " if hint else "")
                      + f"use {', '.join(NAMED)}, a Jinja string, or null for the tokenizer's own",
                      "data.chat_template")


def render_prompt(tokenizer, prompt, template: str | None, apply: bool = True, tools: list[dict] | None = None) -> str:
    """A prompt (string or chat messages) as the text the model continues; with `tools` (schemas),
    as the multi-turn agent loop renders it for the engine (the template lists the tools)."""
    if isinstance(prompt, str) and (not apply or template is None):
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if template is None:
        raise ConfigError("prompts are chat messages but the tokenizer has no chat template; set data.chat_template "
                          "(chatml, qwen, llama3, alpaca, plain or a Jinja string)", "data.chat_template")
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True,
                                         **extra)
