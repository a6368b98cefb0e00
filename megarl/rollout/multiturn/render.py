"""Tool output and simulated-user messages as the tokens appended to a trajectory.

    r = Renderer(tokenizer, template, mode="auto")
    ids = r.tool_tokens(["7"], after_eos=False)       # what follows the model's </tool_call>
    text, cut = truncate_tokens(tokenizer, output, limit=256, side="middle")

chat_template: the text the chat template puts after an assistant message for tool messages (and
the next assistant header), found by rendering a probe conversation with and without them. A turn
that stopped at </tool_call> has not closed the assistant message, so the template's closing text
(Qwen: "<|im_end|>\\n") goes first; after an EOS only the rest of it does.
plain: "\\n<tool_response>output</tool_response>\\n" (one per call), for templates that do not
render tool messages and for base models.
Only the model's own tokens are ever kept as generated; these tokens are tokenized on their own,
so a trajectory never depends on re-tokenizing model text.
"""
from __future__ import annotations

import logging

from megarl.config.errors import ConfigError

log = logging.getLogger("megarl.rollout.multiturn")
_MARK = "MEGARL_PROBE_7c1e"
TRUNCATED = "...(truncated)"
# No tokenizer in use packs more characters than this into one token on average.
MAX_CHARS_PER_TOKEN = 128
_BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]


def truncate_tokens(tokenizer, text: str, limit: int, side: str) -> tuple[str, bool]:
    """Keep `limit` tokens of `text` (the right/left end, or both ends for middle) and mark the cut.

    Only the ends that can be kept are tokenised: `limit` tokens span at most limit * MAX_CHARS_PER_TOKEN
    characters, so a 10 MB output costs a slice, not minutes and gigabytes of token ids.
    """
    head = limit if side == "right" else 0 if side == "left" else limit // 2
    tail = limit - head
    keep_head, keep_tail = head * MAX_CHARS_PER_TOKEN, tail * MAX_CHARS_PER_TOKEN
    if len(text) <= keep_head + keep_tail:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text, False
        first, last = ids[:head], ids[len(ids) - tail:]
    else:                      # over `limit` tokens at any realistic rate: both ends alone decide
        first = tokenizer.encode(text[:keep_head], add_special_tokens=False)[:head] if head else []
        last = tokenizer.encode(text[len(text) - keep_tail:], add_special_tokens=False)[-tail:] if tail else []
    return (tokenizer.decode(first) if first else "") + TRUNCATED + (tokenizer.decode(last) if last else ""), True


class Renderer:
    def __init__(self, tokenizer, template: str | None, mode: str = "auto", key: str = "multi_turn"):
        self.tok = tokenizer
        self.template = template
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_text = eos if isinstance(eos, str) else None
        self.mode = "plain"
        if mode == "plain":
            return
        usable = template is not None and "tool" in template
        if mode == "chat_template" and template is None:
            raise ConfigError("tool_response_render=chat_template but the tokenizer has no chat template; set "
                              "data.chat_template or use tool_response_render=plain", f"{key}.tool_response_render")
        if mode == "auto" and not usable:
            return
        try:
            self.close = self._probe()
        except Exception as err:  # a template may raise anything (jinja2 TemplateError, its own raise_exception)
            if mode == "chat_template":
                raise ConfigError(f"the chat template cannot render tool messages after an assistant message "
                                  f"({err}); use tool_response_render=plain", f"{key}.tool_response_render") from None
            log.warning("chat template cannot render tool messages (%s); tool output uses <tool_response> tags", err)
            return
        self.mode = "chat_template"

    # -- the template's text around a message ----------------------------------------------------------
    def _render(self, messages: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=gen)

    def _probe(self) -> str:
        """The text the template writes after an assistant message's content (checking that tool and
        user messages after it leave the text before them unchanged)."""
        before = self._render(_BASE, gen=False)
        if _MARK not in before:
            raise ValueError("the assistant's text does not appear in the rendering")
        for role in ("tool", "user"):
            self._messages_text(role, [_MARK + "0"])
        return before[before.rindex(_MARK) + len(_MARK):]

    def _messages_text(self, role: str, contents: list[str]) -> str:
        before = self._render(_BASE, gen=False)
        full = self._render(_BASE + [{"role": role, "content": c} for c in contents], gen=True)
        if not full.startswith(before):
            raise ValueError(f"adding {role} messages changes the text before them")
        return full[len(before):]

    def _opening(self, close: str, after_eos: bool) -> str:
        if after_eos and self.eos_text and close.startswith(self.eos_text):
            return close[len(self.eos_text):]
        return close

    # -- what the loop appends ---------------------------------------------------------------------
    def tool_text(self, outputs: list[str], after_eos: bool) -> str:
        if self.mode == "plain":
            return "\n" + "\n".join(f"<tool_response>{o}</tool_response>" for o in outputs) + "\n"
        return self._opening(self.close, after_eos) + self._messages_text("tool", outputs)

    def user_text(self, message: str, after_eos: bool) -> str:
        if self.mode == "plain":
            return "\n" + message + "\n"
        return self._opening(self.close, after_eos) + self._messages_text("user", [message])

    def tool_tokens(self, outputs: list[str], after_eos: bool) -> list[int]:
        return self.tok.encode(self.tool_text(outputs, after_eos), add_special_tokens=False)

    def user_tokens(self, message: str, after_eos: bool) -> list[int]:
        return self.tok.encode(self.user_text(message, after_eos), add_special_tokens=False)
