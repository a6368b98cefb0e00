"""The agent loop on real engines with a tiny model taught the tool format (megarl/examples/tool_use,
~250 SFT steps, cached under .pytest_cache): the log-prob contract across tool turns against a
transformers forward, greedy tool use scored by the example reward through megarl's reward
loading, stop-token vs text cut, the hf engine, and TP=2 ranks agreeing on tool output."""
from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import textwrap

import pytest
import torch

import megarl.examples.tool_use.model as tool_model
from megarl.examples.tool_use.model import build_tokenizer, call_text, prompt_text
from megarl.reward.loading import RewardFnSpec
from megarl.reward.manager import RewardManager
from megarl.reward.scorers import InProcessScorer
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import MultiTurnConfig
from megarl.rollout.multiturn import AgentLoop, load_tools
from megarl.rollout.native import NativeEngine
from tests.distributed import run_ranks
from tests.helpers.multiturn import prompt_batch, rows

PROBLEMS = [(3, 4), (9, 8), (0, 5), (7, 7), (2, 9), (6, 1), (5, 5), (8, 3), (1, 0), (4, 6)]
SEED_TOOLS = os.path.join("megarl", "examples", "tool_use", "tools.yaml")


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    """Trained once per change of the recipe (keyed by its source and library versions), kept in
    pytest's cache; without the cache plugin, once per session."""
    import transformers
    key = hashlib.sha1((inspect.getsource(tool_model) + torch.__version__ + transformers.__version__).encode())
    cache = getattr(request.config, "cache", None)
    root = cache.mkdir("megarl_tool_model") if cache is not None else tmp_path_factory.mktemp("tool_model")
    path = root / key.hexdigest()[:12]
    if not (path / "config.json").exists():
        tok = build_tokenizer()
        model, _ = tool_model.train(tok)
        tmp = str(path) + f".tmp{os.getpid()}"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return str(path)


def batch_for(tok, problems, sampling):
    return prompt_batch(tok, [prompt_text(a, b) for a, b in problems], [str(a + b) for a, b in problems], sampling)


def loop_on(engine, tok, **cfg):
    return AgentLoop(engine, tok, load_tools(SEED_TOOLS), MultiTurnConfig(enable=True, **cfg))


def test_log_probs_match_transformers_across_tool_turns(model_dir):
    """Model tokens after a tool response were generated conditioned on the tool tokens: their
    reported log-probs equal a transformers forward over prompt + full response (fp32, 1e-5);
    tool tokens have mask 0 and are exactly the rendered tool output."""
    from transformers import AutoModelForCausalLM
    tok = build_tokenizer()
    engine = NativeEngine.from_pretrained(model_dir)
    oracle = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = [tok.eos_token_id]
    worst, after_tool = 0.0, 0
    for temperature in (1.0, 0.7):
        sp = SamplingParams(n=2, max_tokens=64, temperature=temperature, seed=5, eos_token_ids=eos)
        out = loop_on(engine, tok).generate_sequences(batch_for(tok, PROBLEMS[:4], sp))
        for i, r in enumerate(rows(out, tok)):
            P, L = int(out.batch["prompt_lens"][i]), len(r["ids"])
            ids = out.batch["input_ids"][i, :P + L]
            with torch.no_grad():
                logits = oracle(input_ids=ids[None]).logits[0, P - 1:P + L - 1].float() / temperature   # [L, V]
            want = torch.log_softmax(logits, -1).gather(-1, ids[P:, None])[:, 0]
            mask = torch.tensor(r["mask"], dtype=torch.bool)
            got = torch.tensor(r["log_probs"])
            worst = max(worst, (want[mask] - got[mask]).abs().max().item())
            assert (got[~mask] == 0).all()
            ok_calls = [c for c in r["calls"] if c["status"] == "ok"]
            expected = "".join(f"\n<tool_response>{c['arguments']['a'] + c['arguments']['b']}</tool_response>\n"
                               for c in ok_calls)
            assert r["tool_text"].startswith(expected) and ok_calls
            first_tool = r["mask"].index(0)
            after_tool += sum(r["mask"][first_tool:])        # model tokens conditioned on tool tokens
    print(f"max |rollout log-prob - transformers| over model tokens = {worst:.2e}; {after_tool} after tool output")
    assert worst <= 1e-5 and after_tool >= 16


def test_greedy_tool_use_scored_by_the_example_reward(model_dir):
    tok = build_tokenizer()
    engine = NativeEngine.from_pretrained(model_dir)
    sp = SamplingParams(n=1, max_tokens=64, do_sample=False, eos_token_ids=[tok.eos_token_id])
    stop_loop = loop_on(engine, tok)
    assert stop_loop.call_stop == tok.convert_tokens_to_ids("</tool_call>")
    before = engine.stats["generated_tokens"]
    out = stop_loop.generate_sequences(batch_for(tok, PROBLEMS, sp))
    stop_tokens = engine.stats["generated_tokens"] - before
    got = rows(out, tok)
    for r, (a, b) in zip(got, PROBLEMS):
        assert r["text"].startswith(call_text(a, b) + f"\n<tool_response>{a + b}</tool_response>\nA: ")
    manager = RewardManager(tok, InProcessScorer(tok, RewardFnSpec(path="megarl/examples/tool_use/reward.py",
                                                                   name="compute_score")))
    result = manager(out)
    scores = result.token_level_scores.sum(-1)
    assert result.extra_info["tool_called"] == [True] * len(PROBLEMS)
    assert scores.mean().item() >= 0.9, [r["text"] for r in got]
    # the score sits on the last model token (the answer's EOS), not on tool output
    last = result.token_level_scores.argmax(-1)
    assert all(out.batch["response_mask"][i, last[i]] == 1 for i in range(len(got)) if scores[i] > 0)

    # Without the one-token stop the turn runs on and is cut after </tool_call>: same sequences,
    # at the cost of the tokens generated past the call (one EOS each for this model).
    text_loop = loop_on(engine, tok)
    text_loop.call_stop = None
    before = engine.stats["generated_tokens"]
    again = rows(text_loop.generate_sequences(batch_for(tok, PROBLEMS, sp)), tok)
    assert [r["ids"] for r in again] == [r["ids"] for r in got]
    assert engine.stats["generated_tokens"] - before == stop_tokens + len(PROBLEMS)


def test_hf_engine_runs_the_same_loop(model_dir):
    from megarl.rollout.hf import HFEngine
    tok = build_tokenizer()
    sp = SamplingParams(n=1, max_tokens=64, do_sample=False, eos_token_ids=[tok.eos_token_id])
    native = rows(loop_on(NativeEngine.from_pretrained(model_dir), tok).generate_sequences(
        batch_for(tok, PROBLEMS[:4], sp)), tok)
    hf = rows(loop_on(HFEngine(model_dir, pad_token_id=tok.pad_token_id), tok).generate_sequences(
        batch_for(tok, PROBLEMS[:4], sp)), tok)
    assert [r["ids"] for r in hf] == [r["ids"] for r in native]
    assert [r["mask"] for r in hf] == [r["mask"] for r in native]
    for a, b in zip(hf, native):
        assert max(abs(x - y) for x, y in zip(a["log_probs"], b["log_probs"])) <= 1e-4


RANK_CALC = '''
import torch.distributed as dist

def add(a, b):
    # a tool whose output differs by rank: without agreement the TP ranks would diverge
    return a + b + 100 * dist.get_rank()
'''


def _tp2(rank, world, model_dir, root):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from megarl.rollout.native import TPComm
    tok = build_tokenizer()
    engine = NativeEngine.from_pretrained(model_dir, comm=TPComm(dist.group.WORLD))
    tools = load_tools(os.path.join(root, "tools.yaml"))
    loop = AgentLoop(engine, tok, tools, MultiTurnConfig(enable=True), tp_group=dist.group.WORLD)
    sp = SamplingParams(n=2, max_tokens=64, temperature=1.0, seed=3, eos_token_ids=[tok.eos_token_id])
    out = loop.generate_sequences(batch_for(tok, PROBLEMS[:3], sp))
    return [(r["ids"], r["tool_text"], r["calls"]) for r in rows(out, tok)]


@pytest.mark.timeout(300)
def test_tp_ranks_agree_on_tool_output(model_dir, tmp_path):
    """Tools run on the TP group's first rank and their output is broadcast: a rank-dependent
    tool gives rank 0's answer on both ranks, and both ranks continue identically."""
    (tmp_path / "rankcalc.py").write_text(RANK_CALC)
    (tmp_path / "tools.yaml").write_text(textwrap.dedent('''
        tools:
          - name: calculator
            description: Add two numbers together
            parameters: [{name: a, type: number}, {name: b, type: number}]
            implementation: rankcalc.py:add
        '''))
    r0, r1 = run_ranks(2, _tp2, (model_dir, str(tmp_path)))
    assert r0 == r1
    ok = 0
    for _, tool_text, calls in r0:
        if calls and calls[0]["status"] == "ok":       # sampled at temperature 1: a call may be malformed
            args = calls[0]["arguments"]
            assert tool_text.startswith(f"\n<tool_response>{args['a'] + args['b']}</tool_response>")
            ok += 1
    assert ok >= 4
