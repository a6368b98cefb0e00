"""Tools of multi-turn rollouts without a model: tools.yaml loading and refusals, the hermes
parser's edge cases, the executor's timeouts and failures (threads here, Ray in its own test),
and the tool-output rendering (plain and through a chat template)."""
from __future__ import annotations

import logging
import textwrap
import time

import pytest

from megarl.config import ConfigError
from megarl.examples.tool_use.model import build_tokenizer
from megarl.rollout.multiturn.builtins import calculate
from megarl.rollout.multiturn.executor import ToolExecutor
from megarl.rollout.multiturn.parser import ToolCall, end_of_call, parse_tool_calls
from megarl.rollout.multiturn.render import Renderer, truncate_tokens
from megarl.rollout.multiturn.tools import load_tools

SEED_000_TOOLS = '''
# tools.yaml
tools:
  - name: "calculator"
    description: "Add two numbers together"
    parameters:
      - name: "a"
        type: "number"
        description: "First number"
      - name: "b"
        type: "number"
        description: "Second number"

  - name: "search"
    description: "Search the internet"
    parameters:
      - name: "query"
        type: "string"
        description: "Search query"
'''

IMPLS = '''
import time

def shout(text):
    return text.upper()

def slow(seconds):
    time.sleep(seconds)
    return "done"

def broken(x):
    raise RuntimeError("database unreachable")

def as_dict(x):
    return {"x": x, "double": 2 * x}
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_seed_000_tools_yaml_loads_as_written(tmp_path, caplog):
    path = write(tmp_path, "tools.yaml", SEED_000_TOOLS)
    with caplog.at_level(logging.INFO, logger="megarl.rollout.multiturn"):
        tools = load_tools(path)
    assert list(tools) == ["calculator", "search"]
    calc, search = tools["calculator"], tools["search"]
    assert calc.implementation == "builtin:calculator" and calc.fn(a=3, b=4) == 7
    assert calc.schema == {"type": "function", "function": {
        "name": "calculator", "description": "Add two numbers together",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "number", "description": "First number"},
            "b": {"type": "number", "description": "Second number"}}}}}
    assert search.fn is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "'search'" in warned[0] and "no implementation" in warned[0]


def test_openai_and_verl_forms_and_implementations(tmp_path):
    write(tmp_path, "impls.py", IMPLS)
    path = write(tmp_path, "tools.yaml", '''
        tools:
          - type: function
            function:
              name: shout
              description: Upper-case a text
              parameters: {type: object, properties: {text: {type: string}}, required: [text]}
            implementation: impls.py:shout
          - tool_schema:
              type: function
              function:
                name: calc_gsm8k_reward
                description: verl's example
                parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
          - name: calculate
            description: Evaluate arithmetic
            parameters: [{name: expression, type: str, description: e.g. (3+4)*2}]
        ''')
    tools = load_tools(path)
    assert tools["shout"].fn(text="hi") == "HI" and tools["shout"].implementation.endswith("impls.py:shout")
    assert tools["calc_gsm8k_reward"].fn is None           # verl's schema form, no implementation: warned
    assert tools["calculate"].implementation == "builtin:calculate"
    assert tools["calculate"].parameters["properties"]["expression"]["type"] == "string"   # `str` alias


BAD = {
    "not yaml": ("tools: [\n  - name: a\n b", "not valid YAML at line"),
    "no list": ("tools: {}", "non-empty list of tools"),
    "no name": ("tools: [{description: x}]", "tools[0] needs a `name`"),
    "duplicate": ("tools: [{name: a}, {name: a}]", "repeats the name 'a'"),
    "param without name": ("tools: [{name: calc, parameters: [{type: number}]}]",
                           "tools[0] ('calc'): parameters[0] needs a name"),
    "bad type": ("tools: [{name: calc, parameters: [{name: a, type: float64}]}]", "has type 'float64'; use one of"),
    "unknown key": ("tools: [{name: calc, implementaton: x.py:f}]", "unknown key 'implementaton'"),
    "verl tool class": ("tools: [{class_name: verl.tools.gsm8k_tool.Gsm8kTool, tool_schema: {name: calc}}]",
                        "is a verl tool class, which megarl does not run; add `implementation:"),
    "bad impl form": ("tools: [{name: calc, implementation: just_a_name}]", "implementation must be"),
    "missing file": ("tools: [{name: calc, implementation: nowhere.py:f}]", "tools[0] ('calc').implementation"),
    "missing function": ("tools: [{name: calc, implementation: 'impls.py:nope'}]", "has no function named 'nope'"),
    "signature": ("tools: [{name: shout, parameters: [{name: words, type: string}], implementation: 'impls.py:shout'}]",
                  "cannot take the tool's parameters (words)"),
    "bad timeout": ("tools: [{name: calc, timeout_s: -1}]", "timeout_s must be"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tools_yaml_is_one_line(tmp_path, case):
    write(tmp_path, "impls.py", IMPLS)
    text, expected = BAD[case]
    path = write(tmp_path, "tools.yaml", text)
    with pytest.raises(ConfigError) as err:
        load_tools(path)
    msg = str(err.value)
    assert "\n" not in msg and expected in msg and msg.startswith("actor_rollout_ref.rollout.tools:"), msg


def test_missing_tools_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tools(str(tmp_path / "nope.yaml"))


def test_hermes_parser_edge_cases():
    ok = '<tool_call>{"name": "calculator", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls("I will add. " + ok + " and then some text") == [ToolCall("calculator", {"a": 1, "b": 2})]
    # several calls, in order; stringified arguments (some models) decode
    two = ok + '\n<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(two)] == [("calculator", {"a": 1, "b": 2}),
                                                                       ("search", {"query": "x"})]
    bad_json = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"a": 1,}}</tool_call>')
    assert bad_json[0].name is None and "not valid JSON" in bad_json[0].error
    no_name = parse_tool_calls('<tool_call>["calculator"]</tool_call>')
    assert "must be a JSON object" in no_name[0].error
    bad_args = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>')
    assert bad_args[0].name == "calculator" and "must be a JSON object" in bad_args[0].error
    unclosed = parse_tool_calls(ok + '<tool_call>{"name": "calcul')
    assert unclosed[0].error is None and "was not closed" in unclosed[1].error
    reopened = parse_tool_calls('<tool_call>{"name": <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert "was not closed" in reopened[0].error and reopened[1] == ToolCall("a", {})
    assert end_of_call("x" + ok + "tail", 1) == 1 + len(ok)
    assert end_of_call(two, 2) == len(two) and end_of_call(ok, 2) is None


def test_executor_statuses_timeouts_and_failures(tmp_path):
    write(tmp_path, "impls.py", IMPLS)
    path = write(tmp_path, "tools.yaml", '''
        tools:
          - {name: calculator, parameters: [{name: a, type: number}, {name: b, type: number}]}
          - {name: search, parameters: [{name: query, type: string}]}
          - {name: slow, parameters: [{name: seconds, type: number}], implementation: impls.py:slow}
          - {name: broken, parameters: [{name: x, type: integer}], implementation: impls.py:broken}
          - {name: as_dict, parameters: [{name: x, type: integer}], implementation: impls.py:as_dict}
        ''')
    ex = ToolExecutor(load_tools(path), timeout_s=0.5, workers=4)
    calls = [ToolCall("calculator", {"a": 3, "b": 4.5}), ToolCall("search", {"query": "x"}),
             ToolCall("nope", {}), ToolCall("calculator", {"a": "3", "b": 4}), ToolCall("calculator", {"a": 3}),
             ToolCall("calculator", {"a": 1, "b": 2, "c": 3}), ToolCall(None, error="the tool call is not valid JSON"),
             ToolCall("slow", {"seconds": 30}), ToolCall("slow", {"seconds": 30}), ToolCall("broken", {"x": 1}),
             ToolCall("as_dict", {"x": 2}), ToolCall("slow", {"seconds": 0.01})]
    start = time.perf_counter()
    res = ex.run(calls)
    took = time.perf_counter() - start
    assert [r.status for r in res] == ["ok", "no_implementation", "unknown_tool", "bad_arguments", "bad_arguments",
                                       "bad_arguments", "parse_error", "timeout", "timeout", "error", "ok", "ok"]
    assert res[0].text == "7.5"
    assert res[1].text == "Error: tool 'search' has no implementation configured"
    assert "available tools: calculator, search, slow, broken, as_dict" in res[2].text
    assert "argument 'a' must be a number, got str '3'" in res[3].text
    assert "missing required argument 'b'" in res[4].text and "unexpected argument 'c'" in res[5].text
    assert res[7].text == "Error: tool 'slow' timed out after 0.5s"
    assert "RuntimeError: database unreachable" in res[9].text
    assert res[10].text == '{"x": 2, "double": 4}' and res[11].text == "done"
    # the two hanging calls ran side by side and did not hold up the others
    assert took < 5.0 and ex.abandoned == 2
    # the next batch is not blocked by the abandoned threads
    assert ex.run([ToolCall("slow", {"seconds": 0.01})])[0].status == "ok"


def test_builtin_calculate_is_arithmetic_only():
    assert calculate("(3 + 4) * 2 - 10 / 4") == 11.5 and calculate("-2 ** 3") == -8
    for bad in ("__import__('os')", "2 ** 1000", "a + 1", "1 +"):
        with pytest.raises(ValueError):
            calculate(bad)


# Qwen2.5's way of rendering tool messages (written with expressions: transformers renders with
# trim_blocks, which eats a newline right after a tag).
QWEN_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_tokenizer():
    from tokenizers import AddedToken
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.eos_token = "<|im_end|>"
    return tok


def test_render_through_chat_template_and_plain():
    tok = chat_tokenizer()
    r = Renderer(tok, QWEN_LIKE, "auto")
    assert r.mode == "chat_template"
    # stopped at </tool_call>: the assistant message is closed first; after EOS only the newline
    after_call = "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\nx\n" \
                 "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert r.tool_text(["7", "x"], after_eos=False) == after_call
    assert r.tool_text(["7", "x"], after_eos=True) == after_call[len("<|im_end|>"):]
    assert r.user_text("try again", after_eos=True) == \
        "\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
    ids = r.tool_tokens(["7"], after_eos=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_end|>") and tok.decode(ids) == r.tool_text(["7"], False)
    plain = Renderer(tok, "{% for m in messages %}{{ m['content'] }}{% endfor %}", "auto")   # renders no tools
    assert plain.mode == "plain" and plain.tool_text(["7"], False) == "\n<tool_response>7</tool_response>\n"
    with pytest.raises(ConfigError, match="tool_response_render=plain"):
        Renderer(tok, "{{ raise_exception('no tools here') }}{% for m in messages %}tool{% endfor %}", "chat_template")


def test_truncate_tool_output_by_tokens():
    tok = build_tokenizer()
    text = "abcdefghij"
    assert truncate_tokens(tok, text, 20, "middle") == (text, False)
    assert truncate_tokens(tok, text, 4, "right") == ("abcd...(truncated)", True)
    assert truncate_tokens(tok, text, 4, "left") == ("...(truncated)ghij", True)
    assert truncate_tokens(tok, text, 4, "middle") == ("ab...(truncated)ij", True)



class _Watched:
    """A tokenizer that records the longest text it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def encode(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text, **kw)

    def decode(self, ids, **kw):
        return self.tok.decode(ids, **kw)


def test_huge_tool_output_is_cut_by_characters_before_tokenising():
    text = "a" + "x" * 20_000_000 + "z"                       # 20 MB of tool output
    for side, want in (("right", "axxx...(truncated)"), ("left", "...(truncated)xxxz"),
                       ("middle", "ax...(truncated)xz")):
        tok = _Watched(build_tokenizer())
        start = time.perf_counter()
        assert truncate_tokens(tok, text, 4, side) == (want, True)
        assert time.perf_counter() - start < 2 and tok.longest < 10_000


@pytest.mark.parametrize("body", ["[" * 1000 + "]" * 1000, "[" * 100_000, '{"name": "f", "arguments": "'
                                  + "[" * 100_000 + '"}'])
def test_deeply_nested_call_is_a_parse_error_not_a_crash(body):
    calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and "nests too deeply" in calls[0].error

def test_interactions_load_by_name_path_and_verl_file(tmp_path):
    from megarl.rollout.multiturn.interactions import load_interactions, pick
    (tmp_path / "users.py").write_text(textwrap.dedent('''
        def nudge(response, *, sample, turn):
            return None if sample["ground_truth"] in response else "check again"

        class Teacher:
            def __init__(self, config):
                self.word = config["word"]
            def respond(self, response, *, sample, turn):
                return self.word
        '''))
    (tmp_path / "interactions.yaml").write_text(textwrap.dedent(f'''
        interaction:
          - name: teacher
            class_name: {tmp_path}/users.py:Teacher
            config: {{word: again}}
        '''))
    got = load_interactions(["conversation", f"{tmp_path}/users.py:nudge"], str(tmp_path / "interactions.yaml"))
    assert list(got) == ["conversation", f"{tmp_path}/users.py:nudge", "teacher"]
    assert got["conversation"] is None
    assert got[f"{tmp_path}/users.py:nudge"]("A: 5", sample={"ground_truth": "7"}, turn=1) == "check again"
    assert pick(got, {"interaction_kwargs": {"name": "teacher"}})("x", sample={}, turn=1) == "again"
    assert pick(got, {}) is None                       # the first: conversation
    with pytest.raises(ConfigError, match="unknown interaction 'chat'"):
        load_interactions(["chat"], None)
    with pytest.raises(ValueError, match="asks for interaction 'tutor'"):
        pick(got, {"interaction_kwargs": {"name": "tutor"}})


def test_example_reward_from_text_or_records():
    from megarl.examples.tool_use.reward import compute_score
    call = '<tool_call>{"name": "calculator", "arguments": {"a": 3, "b": 4}}</tool_call>'
    text = call + "\n<tool_response>7</tool_response>\nA: 7"
    assert compute_score("tool_use", text, "7") == {"score": 1.0, "tool_called": True, "acc": True}
    assert compute_score("tool_use", "A: 7", "7")["score"] == 0.5                  # right answer, no tool
    wrong_tool = text.replace("calculator", "search")
    assert compute_score("tool_use", wrong_tool, "7")["tool_called"] is False
    # the loop's records win over the text: a call that failed does not count
    failed = {"tool_calls": [{"name": "calculator", "arguments": {}, "status": "bad_arguments", "turn": 1}]}
    assert compute_score("tool_use", text, "7", extra_info=failed) == {"score": 0.5, "tool_called": False,
                                                                       "acc": True}
