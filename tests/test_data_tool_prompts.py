"""Multi-turn prompts are measured as the agent loop renders them: with a chat template that lists
the tools (tools=... as in configs/tool_use.yaml), data.max_prompt_length, filter_overlong_prompts
and `--check` (megarl/launcher/preflight_data.py) count the tool list too, as verl's RLHFDataset
does. The engine in the loop test is the scripted FAKE of tests/helpers/multiturn.py (no model)."""
from __future__ import annotations

import json
import textwrap

import pytest

from megarl.config import ConfigError
from megarl.data.build import build_loaders
from megarl.data.loader import collate
from megarl.examples.tool_use.model import build_tokenizer
from megarl.experiment import build_config
from megarl.launcher.preflight_data import check_datasets
from megarl.rollout.base import SamplingParams
from megarl.rollout.multiturn import build_agent_loop, prompt_tool_schemas
from tests.helpers.multiturn import ScriptedEngine

TOK = build_tokenizer()
TOOLS_TEMPLATE = ("{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}"
                  "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
SHORT, LONG = "Q: 2+3\n", "Q: 2+3 then 4+5\n"


def _length(text: str, tools: bool) -> int:
    prefix = "tools: calculator search\n" if tools else ""
    return len(TOK.encode(prefix + text, add_special_tokens=False))


def _cfg(tmp_path, **data):
    (tmp_path / "tools.yaml").write_text(textwrap.dedent('''
        tools:
          - name: calculator
            description: Add two numbers together
            parameters:
              - {name: a, type: number, description: First number}
              - {name: b, type: number, description: Second number}
          - name: search
            description: Search the internet
            parameters: [{name: query, type: string, description: Search query}]
        '''))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}], "data_source": "tool_use",
                                        "reward_model": {"ground_truth": "5"}}) + "\n" for q in (SHORT, LONG)))
    limit = _length(SHORT, tools=True)
    # LONG fits without the tool list and not with it; SHORT fits with it
    assert _length(LONG, tools=False) <= limit < _length(LONG, tools=True)
    return build_config({"data": {"chat_template": TOOLS_TEMPLATE, "train_files": [str(rows)], "train_batch_size": 1,
                                  "max_prompt_length": limit, **data},
                         "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 1},
                                               "rollout": {"tools": str(tmp_path / "tools.yaml")}}})


def test_the_filter_counts_the_tool_list_and_keeps_what_the_loop_sends(tmp_path):
    cfg = _cfg(tmp_path)
    schemas = prompt_tool_schemas(cfg, TOK)
    assert [s["function"]["name"] for s in schemas] == ["calculator", "search"]
    train, _ = build_loaders(cfg.data, TOK, schemas)
    assert [item["raw_prompt"][0]["content"] for item in train.dataset] == [SHORT]
    assert train.dataset.report["filtered_overlong"] == 1
    # the kept prompt's ids are the ones the agent loop gives the engine
    engine = ScriptedEngine(TOK, lambda context, j: "A: 5")
    batch = collate([train.dataset[0]])
    batch.meta_info.update(sampling=SamplingParams(n=1, max_tokens=8, eos_token_ids=[TOK.eos_token_id]),
                           pad_token_id=TOK.pad_token_id)
    out = build_agent_loop(cfg, engine, TOK).generate_sequences(batch)
    sent = list(out.non_tensor_batch["prompt_token_ids"][0])
    assert sent == train.dataset[0]["prompt_token_ids"] and TOK.decode(sent).startswith("tools: calculator search")
    # without a template that lists tools, or with tools_in_prompt off, nothing is added
    off = build_config({"data": {"chat_template": TOOLS_TEMPLATE}, "actor_rollout_ref": {"rollout": {
        "tools": str(tmp_path / "tools.yaml"), "multi_turn": {"tools_in_prompt": False}}}})
    assert prompt_tool_schemas(off, TOK) is None


def test_check_refuses_a_prompt_that_is_over_the_limit_with_its_tools(tmp_path):
    cfg = _cfg(tmp_path, filter_overlong_prompts=False)
    with pytest.raises(ConfigError, match=r"^data.train_files: .*rows.jsonl line 2: prompt has "
                                          rf"{_length(LONG, tools=True)} tokens, over data.max_prompt_length="):
        check_datasets(cfg, TOK)
