"""The agent loop's control flow, driven by a scripted FAKE engine (tests/helpers/multiturn.py):
batching of turns, cuts after calls, parallel-call limits, error/timeout paths, the response
budget, max turns, simulated users, seeds, metrics, and the config entry point. The real engine
and the log-prob contract are in tests/test_multiturn_engine.py."""
from __future__ import annotations

import re
import textwrap

import pytest

from megarl.config import ConfigError
from megarl.experiment import build_config, load_config
from megarl.examples.tool_use.model import build_tokenizer, call_text
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import MultiTurnConfig, RolloutConfig
from megarl.rollout.multiturn import AgentLoop, build_agent_loop, load_tools, multiturn_metrics
from megarl.rollout.multiturn.loop import turn_seed
from megarl.rollout.trtllm import detect_features, llm_kwargs
from tests.helpers.multiturn import ScriptedEngine, fake_log_prob, prompt_batch, rows
from tests.rollout import trtllm_fake

TOK = build_tokenizer()
TOK_SPELLED = build_tokenizer(tool_tokens=False)     # </tool_call> is 12 tokens here
EOS = "<eos>"


def calculator_tools(tmp_path, extra: str = ""):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent('''
        tools:
          - name: calculator
            description: Add two numbers together
            parameters:
              - {name: a, type: number, description: First number}
              - {name: b, type: number, description: Second number}
          - name: search
            description: Search the internet
            parameters: [{name: query, type: string, description: Search query}]
        ''') + textwrap.indent(textwrap.dedent(extra), "  "))
    return load_tools(str(path))


def operands(context: str) -> tuple[int, int]:
    a, b = re.search(r"Q: (\d+)\+(\d+)", context).groups()
    return int(a), int(b)


def solver(context: str, j: int) -> str:
    """Call the calculator, then answer with what it returned."""
    outputs = re.findall(r"<tool_response>(.*?)</tool_response>", context)
    if not outputs:
        return call_text(*operands(context)) + EOS
    return f"A: {outputs[-1]}" + EOS


def sampling(**kw) -> SamplingParams:
    base = dict(n=2, max_tokens=80, seed=11, temperature=1.0, eos_token_ids=[TOK.eos_token_id])
    return SamplingParams(**{**base, **kw})


def check_alignment(r: dict) -> None:
    """Model tokens carry the engine's log-probs, tool tokens 0, and nothing else moved."""
    for t, m, lp in zip(r["ids"], r["mask"], r["log_probs"]):
        assert lp == pytest.approx(fake_log_prob(t) if m else 0.0, abs=1e-7)


def test_turns_are_batched_seeded_and_aligned(tmp_path):
    engine = ScriptedEngine(TOK, solver)
    loop = AgentLoop(engine, TOK, calculator_tools(tmp_path), MultiTurnConfig(enable=True))
    batch = prompt_batch(TOK, ["Q: 3+4\n", "Q: 9+8\n"], ["7", "17"], sampling())
    out = loop.generate_sequences(batch)
    # one engine call per round: the first with n=2, then all 4 continuations together with n=1
    assert [(k, sp.n) for k, sp in engine.calls] == [(2, 2), (4, 1)]
    assert engine.calls[0][1].seed == 11 and engine.calls[1][1].seed == turn_seed(11, 1) != 11
    assert TOK.convert_tokens_to_ids("</tool_call>") in engine.calls[0][1].stop_token_ids
    got = rows(out, TOK)
    assert len(got) == 4 and [r["finish"] for r in got] == ["stop"] * 4
    for r, (a, b) in zip(got, [(3, 4), (3, 4), (9, 8), (9, 8)]):
        assert r["text"] == call_text(a, b) + f"\n<tool_response>{a + b}</tool_response>\nA: {a + b}" + EOS
        assert r["tool_text"] == f"\n<tool_response>{a + b}</tool_response>\n"
        check_alignment(r)
        assert r["calls"] == [{"name": "calculator", "arguments": {"a": a, "b": b}, "status": "ok", "turn": 1}]
    assert list(out.non_tensor_batch["num_turns"]) == [2] * 4
    info = out.non_tensor_batch["extra_info"][1]
    assert info["index"] == 0 and info["num_turns"] == 2 and info["tool_calls"][0]["status"] == "ok"
    m = out.meta_info["metrics"]
    assert m["multiturn/tool_calls/total"] == 4 and m["multiturn/assistant_turns/mean"] == 2
    assert m["multiturn/tool_errors"] == 0 and \
        m == {**multiturn_metrics(out), "timing_s/agent_loop": m["timing_s/agent_loop"]}
    # the token-level interface gives the same completions
    groups = loop.generate([list(p) for p in batch.non_tensor_batch["prompt_token_ids"]], sampling())
    assert [c.token_ids for g in groups for c in g] == [r["ids"] for r in got]


@pytest.mark.parametrize("tok", [TOK, TOK_SPELLED], ids=["close-is-one-token", "close-spelled-out"])
def test_text_after_a_call_is_dropped_and_parallel_limit(tmp_path, tok):
    def chatty(context, j):
        if "<tool_response>" in context:
            return "A: done" + EOS
        return "let me add. " + call_text(1, 2) + " and also " + call_text(3, 4) + " more text" + EOS

    tools = calculator_tools(tmp_path)
    one = AgentLoop(ScriptedEngine(tok, chatty), tok, tools, MultiTurnConfig(enable=True))
    r = rows(one.generate_sequences(prompt_batch(tok, ["Q: 1+2\n"], ["3"], sampling(n=1, max_tokens=400))), tok)[0]
    assert r["text"] == ("let me add. " + call_text(1, 2) + "\n<tool_response>3</tool_response>\nA: done" + EOS)
    assert [c["arguments"] for c in r["calls"]] == [{"a": 1, "b": 2}]
    check_alignment(r)
    two = AgentLoop(ScriptedEngine(tok, chatty), tok, tools, MultiTurnConfig(enable=True, max_parallel_calls=2))
    assert two.call_stop is None                  # several calls per turn: the turn must not stop at the first
    r = rows(two.generate_sequences(prompt_batch(tok, ["Q: 1+2\n"], ["3"], sampling(n=1, max_tokens=400))), tok)[0]
    assert r["text"] == ("let me add. " + call_text(1, 2) + " and also " + call_text(3, 4)
                         + "\n<tool_response>3</tool_response>\n<tool_response>7</tool_response>\nA: done" + EOS)
    assert [c["status"] for c in r["calls"]] == ["ok", "ok"]
    check_alignment(r)


def test_errors_go_back_to_the_model_and_are_counted(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ndef wait(seconds):\n    time.sleep(seconds)\n    return 'late'\n"
                                      "def boom():\n    raise KeyError('nope')\n")
    tools = calculator_tools(tmp_path, '''
          - {name: wait, parameters: [{name: seconds, type: number}], implementation: slow.py:wait, timeout_s: 0.3}
          - {name: boom, implementation: slow.py:boom}
        ''')
    first_turn = {
        "Q: 1": '<tool_call>{"name": "calculator", "arguments": {"a": 1,}}</tool_call>',
        "Q: 2": '<tool_call>{"name": "weather", "arguments": {}}</tool_call>',
        "Q: 3": '<tool_call>{"name": "search", "arguments": {"query": "megarl"}}</tool_call>',
        "Q: 4": '<tool_call>{"name": "calculator", "arguments": {"a": "4"}}</tool_call>',
        "Q: 5": '<tool_call>{"name": "wait", "arguments": {"seconds": 30}}</tool_call>',
        "Q: 6": '<tool_call>{"name": "boom", "arguments": {}}</tool_call>',
        "Q: 7": '<tool_call>{"name": "calculator", "arguments": {"a": 1, "b": 2}',   # never closed, then EOS
    }

    def script(context, j):
        if "<tool_response>" in context:
            return "A: " + ("saw error" if "Error:" in context else "fine") + EOS
        return first_turn[context[:4]] + EOS

    loop = AgentLoop(ScriptedEngine(TOK, script), TOK, tools, MultiTurnConfig(enable=True))
    prompts = [f"Q: {i}+0\n" for i in range(1, 8)]
    out = loop.generate_sequences(prompt_batch(TOK, prompts, ["0"] * 7, sampling(n=1, max_tokens=300)))
    got = rows(out, TOK)
    statuses = [r["calls"][0]["status"] for r in got]
    assert statuses == ["parse_error", "unknown_tool", "no_implementation", "bad_arguments", "timeout", "error",
                        "parse_error"]
    assert "tool 'search' has no implementation configured" in got[2]["tool_text"]
    assert "timed out after 0.3s" in got[4]["tool_text"] and "KeyError" in got[5]["tool_text"]
    assert "was not closed" in got[6]["tool_text"]
    assert all(r["text"].endswith("A: saw error" + EOS) for r in got)
    m = out.meta_info["metrics"]
    assert m["multiturn/tool_errors"] == 7 and m["multiturn/tool_error_rate"] == 1.0
    assert m["multiturn/tool_timeout"] == 1 and m["multiturn/tool_no_implementation"] == 1
    assert m["multiturn/tool_parse_error"] == 2 and m["multiturn/tool_error"] == 1


def test_a_deeply_nested_call_is_counted_as_a_parse_error(tmp_path):
    deep = "<tool_call>" + "[" * 1500 + "]" * 1500 + "</tool_call>"

    def script(context, j):
        return ("A: saw error" if "<tool_response>" in context else deep) + EOS

    loop = AgentLoop(ScriptedEngine(TOK, script), TOK, calculator_tools(tmp_path), MultiTurnConfig(enable=True))
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 1+0\n"], ["1"], sampling(n=1, max_tokens=4000)))
    r = rows(out, TOK)[0]
    assert r["calls"][0]["status"] == "parse_error" and "nests too deeply" in r["tool_text"]
    assert out.meta_info["metrics"]["multiturn/tool_parse_error"] == 1

def test_budget_counts_tool_tokens_and_truncates(tmp_path):
    def big(context, j):
        return call_text(1, 2) + EOS

    (tmp_path / "big.py").write_text("def dump():\n    return 'x' * 500\n")
    tools = calculator_tools(tmp_path, "  - {name: dump, implementation: big.py:dump}\n")
    tools_call = '<tool_call>{"name":"dump","arguments":{}}</tool_call>'
    script = lambda context, j: (tools_call if "<tool_response>" not in context else "A: ok") + EOS  # noqa: E731
    cfg = MultiTurnConfig(enable=True, max_tool_response_length=10, tool_response_truncate_side="right")
    loop = AgentLoop(ScriptedEngine(TOK, script), TOK, tools, cfg)
    r = rows(loop.generate_sequences(prompt_batch(TOK, ["Q: 1+2\n"], ["3"], sampling(n=1, max_tokens=100))), TOK)[0]
    assert r["tool_text"] == "\n<tool_response>" + "x" * 10 + "...(truncated)</tool_response>\n"
    assert r["finish"] == "stop"
    # a budget that ends inside the tool output: cut there, finish "length", response exactly the budget
    budget = len(TOK.encode(tools_call, add_special_tokens=False)) + 6
    loop = AgentLoop(ScriptedEngine(TOK, script), TOK, tools, cfg)
    r = rows(loop.generate_sequences(prompt_batch(TOK, ["Q: 1+2\n"], ["3"], sampling(n=1, max_tokens=budget))), TOK)[0]
    assert len(r["ids"]) == budget and r["finish"] == "length" and r["mask"][-6:] == [0] * 6
    # a budget that ends inside the model's call: no tool runs
    loop = AgentLoop(ScriptedEngine(TOK, big), TOK, tools, cfg)
    r = rows(loop.generate_sequences(prompt_batch(TOK, ["Q: 1+2\n"], ["3"], sampling(n=1, max_tokens=9))), TOK)[0]
    assert len(r["ids"]) == 9 and r["finish"] == "length" and r["calls"] == [] and set(r["mask"]) == {1}


def test_max_assistant_turns_and_later_turns_get_the_remaining_budget(tmp_path):
    always = lambda context, j: call_text(1, 1) + EOS    # noqa: E731
    engine = ScriptedEngine(TOK, always)
    loop = AgentLoop(engine, TOK, calculator_tools(tmp_path), MultiTurnConfig(enable=True, max_assistant_turns=3))
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 1+1\n"], ["2"], sampling(n=1, max_tokens=200)))
    r = rows(out, TOK)[0]
    assert out.non_tensor_batch["num_turns"][0] == 3 and len(r["calls"]) == 2 and r["finish"] == "length"
    assert r["text"].endswith(call_text(1, 1))       # the third call is not run: no turn would follow it
    used = [len(TOK.encode(call_text(1, 1))), len(TOK.encode("\n<tool_response>2</tool_response>\n"))]
    assert [sp.max_tokens for _, sp in engine.calls] == [200, 200 - sum(used), 200 - 2 * sum(used)]


def test_simulated_user_turns(tmp_path):
    def script(context, j):
        if "<tool_response>" not in context:
            return call_text(2, 2) + EOS
        return ("A: 4" if "try again" in context else "A: 5") + EOS

    seen = []

    def teacher(response, *, sample, turn):
        seen.append((response, sample["ground_truth"], turn))
        return None if response.startswith("A: " + sample["ground_truth"]) else "try again"

    loop = AgentLoop(ScriptedEngine(TOK, script), TOK, calculator_tools(tmp_path),
                     MultiTurnConfig(enable=True, max_user_turns=2), interactions={"teacher": teacher})
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 2+2\n"], ["4"], sampling(n=1)))
    r = rows(out, TOK)[0]
    assert r["text"].endswith("A: 5" + EOS + "\ntry again\nA: 4" + EOS) and r["finish"] == "stop"
    assert seen == [("A: 5" + EOS, "4", 2), ("A: 4" + EOS, "4", 3)]
    assert out.non_tensor_batch["user_turns"][0] == 1 and r["tool_text"].endswith("\ntry again\n")
    check_alignment(r)


def test_config_entry_point_with_seed_keys(tmp_path, monkeypatch):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: calculator\n    description: Add two numbers together\n    parameters:\n"
                    "      - {name: a, type: number, description: First number}\n"
                    "      - {name: b, type: number, description: Second number}\n")
    cfg = load_config(None, [f"actor_rollout_ref.rollout.tools={path}",
                             "actor_rollout_ref.rollout.interactions=[conversation]",
                             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4", "data.chat_template=plain"])
    assert cfg.rollout.multi_turn.enable
    engine = ScriptedEngine(TOK, solver)
    loop = build_agent_loop(cfg, engine, TOK)
    assert loop.engine is engine and not hasattr(loop, "calls")     # the contract by name, nothing forwarded
    assert loop.renderer.mode == "plain" and list(loop.tools) == ["calculator"]
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 5+1\n"], ["6"], sampling(n=1)))
    assert rows(out, TOK)[0]["text"].endswith("A: 6" + EOS)
    with pytest.raises(ConfigError, match="unknown interaction 'chatbot'"):
        build_agent_loop(load_config(None, [f"actor_rollout_ref.rollout.tools={path}",
                                            "actor_rollout_ref.rollout.interactions=[chatbot]"]), engine, TOK)
    # TensorRT-LLM must accept continuation prompts (prompt + response so far)
    tllm = trtllm_fake.install(monkeypatch, "trtllm-1.3.0rc21.json")   # the strict fake of 1.3's LLM args
    kw = llm_kwargs(RolloutConfig(prompt_length=100, response_length=28, tools=str(path)), "/m",
                    detect_features(tllm), tllm.llmapi.llm_args)
    assert kw["max_input_len"] == 128
    with pytest.raises(ConfigError, match="set format=hermes"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.format=json"])
    with pytest.raises(ConfigError, match="max_assistant_turns"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"])


TOOLS_TEMPLATE = ("{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}"
                  "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_tools_in_prompt_rerenders_chat_prompts(tmp_path):
    """With a chat template that renders tools=..., the prompts the engine sees list the tools, and
    the batch keeps those prompts (input_ids = the prompt generated from + response)."""
    engine = ScriptedEngine(TOK, solver)
    loop = AgentLoop(engine, TOK, calculator_tools(tmp_path), MultiTurnConfig(enable=True),
                     prompt_template=TOOLS_TEMPLATE)
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 2+3\n"], ["5"], sampling(n=1)))
    prompt = TOK.decode(list(out.non_tensor_batch["prompt_token_ids"][0]))
    assert prompt == "tools: calculator search\nQ: 2+3\n"
    assert TOK.decode(out.batch["input_ids"][0, :len(TOK.encode(prompt))].tolist()) == prompt
    assert rows(out, TOK)[0]["text"].endswith("A: 5" + EOS)
    def cfg(**multi_turn):      # a built config is frozen: one per variant
        return build_config({"data": {"chat_template": TOOLS_TEMPLATE},
                             "actor_rollout_ref": {"rollout": {"tools": str(tmp_path / "tools.yaml"),
                                                               "multi_turn": multi_turn}}})
    assert build_agent_loop(cfg(), engine, TOK).prompt_template == TOOLS_TEMPLATE
    assert build_agent_loop(cfg(tools_in_prompt=False), engine, TOK).prompt_template is None


def test_continuations_get_a_prompt_limit_not_a_changed_guard(tmp_path):
    """Later turns' prompts hold the response so far: the loop passes them a limit of
    prompt_length + max_tokens as an argument; the engine's own guard never changes."""
    from megarl.rollout.prompts import PromptGuard

    class Guarded(ScriptedEngine):
        def __init__(self, *a):
            super().__init__(*a)
            self.guard, self.limits = PromptGuard(max_length=8), []

        def generate(self, prompts, sampling, prompt_limit=None):
            self.limits.append((prompt_limit, self.guard.max_length, max(map(len, prompts))))
            return super().generate(self.guard.apply(prompts, max_length=prompt_limit), sampling)

    engine = Guarded(TOK, solver)
    loop = AgentLoop(engine, TOK, calculator_tools(tmp_path), MultiTurnConfig(enable=True))
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 3+4\n"], ["7"], sampling(n=1)))
    assert rows(out, TOK)[0]["text"].endswith("A: 7" + EOS)
    later = engine.limits[1:]
    assert engine.limits[0][:2] == (None, 8) and [x[:2] for x in later] == [(8 + 80, 8)] * len(later)
    assert len(engine.limits) > 1 and max(n for *_, n in engine.limits) > 8     # longer than the guard's own 8
    with pytest.raises(ValueError, match="prompt_length=8"):
        engine.generate([[1] * 9], sampling(n=1))


def test_a_rows_tools_kwargs_reach_the_tool_as_verl_passes_them(tmp_path):
    """verl's extra_info.tools_kwargs: {tool: {create_kwargs, execute_kwargs}}, per row; a tool that
    names those keyword parameters gets its own part ({} where the row has none)."""
    (tmp_path / "impl.py").write_text(
        "def add(a, b, *, create_kwargs, execute_kwargs):\n"
        "    return f\"{a + b + create_kwargs.get('offset', 0)} {sorted(execute_kwargs)}\"\n")
    (tmp_path / "tools.yaml").write_text(textwrap.dedent('''
        tools:
          - name: calculator
            description: Add two numbers together
            parameters:
              - {name: a, type: number, description: First number}
              - {name: b, type: number, description: Second number}
            implementation: impl.py:add
        '''))
    loop = AgentLoop(ScriptedEngine(TOK, solver), TOK, load_tools(str(tmp_path / "tools.yaml")),
                     MultiTurnConfig(enable=True))
    extra = [{"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {"offset": 100},
                                                          "execute_kwargs": {"trace": True}}}},
             {"index": 1, "tools_kwargs": {"other_tool": {"create_kwargs": {"offset": 5}}}}]
    out = loop.generate_sequences(prompt_batch(TOK, ["Q: 3+4\n", "Q: 9+8\n"], ["7", "17"], sampling(), extra))
    got = [r["tool_text"] for r in rows(out, TOK)]
    assert got == (["\n<tool_response>107 ['trace']</tool_response>\n"] * 2
                   + ["\n<tool_response>17 []</tool_response>\n"] * 2)


def test_a_tool_parameter_cannot_take_verls_row_kwargs_name(tmp_path):
    (tmp_path / "impl.py").write_text("def f(create_kwargs):\n    return 1\n")
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: f\n    description: d\n    parameters:\n"
                                         "      - {name: create_kwargs, type: object, description: x}\n"
                                         "    implementation: impl.py:f\n")
    with pytest.raises(ConfigError, match="create_kwargs' is the name of verl's per-row tools_kwargs"):
        load_tools(str(tmp_path / "tools.yaml"))
