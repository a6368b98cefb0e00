"""R3's rollout side: the built-in engine records, per token and MoE layer, the experts its own
router chose, and they reach the batch as `routed_experts` aligned with input_ids.

The oracle is transformers: its Qwen3-MoE / Qwen2-MoE forward over the whole sequence (prompt +
response) with output_router_logits, top-k of the router's softmax, in fp32. Routers get weights
large enough that fp32 noise cannot flip a choice (megarl.models.tiny), so any difference is a bug
in what the engine records or where it puts it (continuous batching moves rows and prompt
groups; the n samples of a prompt share one prefill).

    python -m pytest -q tests/rollout/test_routes.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.models.tiny import make_tiny_hf
from megarl.protocol import DataProto
from megarl.rollout.base import Completion, SamplingParams, pack_completions
from megarl.rollout.native import NativeEngine

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [40, 41], [77, 78, 79, 80]]


def oracle_routes(model, seq: list[int], topk: int) -> torch.Tensor:
    """transformers' top-k experts for every position of seq: [T, MoE layers, topk] (int64)."""
    out = model(torch.tensor([seq]), output_router_logits=True)
    return torch.stack([logits.float().softmax(-1).topk(topk, dim=-1).indices for logits in out.router_logits], 1)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = make_tiny_hf(str(tmp_path_factory.mktemp(request.param)), request.param, tokenizer=False,
                        num_hidden_layers=3, seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("static", [False, True])
def test_recorded_routes_equal_transformers_under_continuous_batching(moe, static):
    """5 prompts x n=3 through 6 rows (rows and prompt groups move as samples finish at stop
    tokens): every sample's routes, prompt and fed tokens, equal transformers' on its sequence;
    the n samples of a prompt got their prompt routes from its one prefill. static: the padded
    step a CUDA graph replays (bucketed rows, parked padding rows), run eagerly."""
    path, model = moe
    engine = NativeEngine.from_pretrained(path, dtype="float32", record_routes=True, max_num_seqs=6)
    engine.decode.static = static
    sp = SamplingParams(n=3, max_tokens=9, seed=4, stop_token_ids=[3, 4, 5, 6, 7, 8, 9, 10])
    groups = engine.generate(PROMPTS, sp)
    assert engine.stats["prefills"] == len(PROMPTS)              # one prefill per prompt, shared by n
    assert engine.stats["group_moves"] > 0                       # the moving paths ran
    lengths = set()
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            seq = prompt + c.token_ids
            r = c.routed_experts
            # every position the engine fed: the prompt and all sampled tokens but the last
            assert r.dtype == torch.uint8 and tuple(r.shape) == (len(seq) - 1, 3, 2)
            assert torch.equal(r.long(), oracle_routes(model, seq, 2)[:-1])
            lengths.add(len(c.token_ids))
        assert all(torch.equal(c.routed_experts[:len(prompt)], group[0].routed_experts[:len(prompt)]) for c in group)
    assert len(lengths) > 2                                      # samples stopped at different steps


def test_batch_field_layout_and_recording_off(moe):
    """routed_experts [B, S, L, K] aligned with input_ids: padding 0, the final sampled token a copy
    of the position before it; off (the default), nothing is recorded or packed."""
    path, model = moe
    prompts = PROMPTS[:3]
    batch = DataProto.from_dict(non_tensors={"prompt_token_ids": np.array([list(p) for p in prompts] + [[]],
                                                                          dtype=object)[:3]})
    sp = SamplingParams(n=2, max_tokens=6, seed=1, stop_token_ids=[3, 4, 5, 6, 7, 8])
    on = NativeEngine.from_pretrained(path, dtype="float32", record_routes=True)
    out = pack_completions(batch, on.generate(prompts, sp), pad_token_id=0)
    ids, routes = out.batch["input_ids"], out.batch["routed_experts"]
    assert routes.dtype == torch.uint8 and routes.shape == (*ids.shape, 3, 2)
    for i in range(len(ids)):
        n = int(out.batch["prompt_lens"][i] + out.batch["response_lens"][i])
        want = oracle_routes(model, ids[i, :n].tolist(), 2)
        assert torch.equal(routes[i, :n - 1].long(), want[:-1])
        assert torch.equal(routes[i, n - 1], routes[i, n - 2])                # the never-fed last token
        assert not routes[i, n:].any()                                        # padding
    off = NativeEngine.from_pretrained(path, dtype="float32")
    assert off.generate(prompts, sp)[0][0].routed_experts is None
    assert "routed_experts" not in pack_completions(batch, off.generate(prompts, sp), pad_token_id=0).batch
    assert off.row_costs(8, 8) < on.row_costs(8, 8)                           # the record is budgeted


def test_a_continuation_prefill_routes_inserted_tokens(moe):
    """Multi-turn / partial rollouts: the next call's prompt holds the response so far plus tokens
    the engine never generated (tool output); its prefill routes all of them like a full forward."""
    path, model = moe
    engine = NativeEngine.from_pretrained(path, dtype="float32", record_routes=True)
    first = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, seed=2))[0][0]
    context = PROMPTS[0] + first.token_ids + [50, 51, 52]                      # + "tool output"
    second = engine.generate([context], SamplingParams(max_tokens=3, seed=3))[0][0]
    seq = context + second.token_ids
    assert torch.equal(second.routed_experts.long(), oracle_routes(model, seq, 2)[:-1])


def test_pack_routes_rules():
    """Mixed recorded / unrecorded completions are refused; int16 past 256 experts; a record longer
    than the kept tokens (a multi-turn cut) is cut to them."""
    from megarl.rollout.native.moe import routes_dtype
    assert routes_dtype(256) == torch.uint8 and routes_dtype(257) == torch.int16
    batch = DataProto.from_dict(non_tensors={"prompt_token_ids": np.array([[1, 2], [3, 4]], dtype=object)})
    rec = torch.arange(2 * 6).view(6, 1, 2).to(torch.int16)
    groups = [[Completion([5, 6], [0.0, 0.0], "stop", routed_experts=rec)],
              [Completion([7], [0.0], "stop", routed_experts=None)]]
    with pytest.raises(ValueError, match="some completions carry routes"):
        pack_completions(batch, groups, pad_token_id=0)
    groups[1][0].routed_experts = rec[:2]
    out = pack_completions(batch, groups, pad_token_id=0).batch["routed_experts"]
    assert out.dtype == torch.int16 and out.shape == (2, 4, 1, 2)
    assert torch.equal(out[0], rec[:4]) and torch.equal(out[1, 2], rec[1]) and not out[1, 3].any()
    # rollout-DP groups' batches of different widths gather into one (megarl/trainer/loop/generation.py)
    short = pack_completions(batch[[1]], [groups[1]], pad_token_id=0)
    both = DataProto.concat([short, pack_completions(batch, groups, pad_token_id=0)])
    assert both.batch["routed_experts"].shape == (3, 4, 1, 2) and not both.batch["routed_experts"][0, 3].any()
    assert torch.equal(both.batch["routed_experts"][0, :3], out[1, :3])


def test_r3_refused_where_no_engine_records():
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    r3 = ["actor_rollout_ref.actor.router_replay.mode=R3",
          "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    for name, words in (("hf", "transformers' generate"),):
        with pytest.raises(ConfigError, match=words) as err:
            load_config(None, r3 + [f"actor_rollout_ref.rollout.name={name}"])
        assert "\n" not in str(err.value) and "rollout.name=native" in str(err.value)
    assert load_config(None, r3).rollout.enable_rollout_routing_replay
    with pytest.raises(ConfigError, match="record_routes"):
        from megarl.rollout.build_args import engine_options
        engine_options(NativeEngine, {}, {"record_routes": True}, "native")


def test_agent_loop_routes_cover_user_turns(tmp_path):
    """Multi-turn: simulated-user tokens are never generated by the engine; the next turn's prefill
    routes them. The packed routes of a 3-turn trajectory equal transformers' at every position
    the engine fed (all but the final sampled token)."""
    from transformers import AutoModelForCausalLM

    from megarl.examples.tool_use.model import build_tokenizer
    from megarl.rollout.config import MultiTurnConfig
    from megarl.rollout.multiturn import AgentLoop
    from tests.helpers.multiturn import prompt_batch
    tok = build_tokenizer()
    path = make_tiny_hf(str(tmp_path / "m"), "qwen3_moe", tokenizer=False, vocab_size=len(tok), num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = NativeEngine.from_pretrained(path, dtype="float32", record_routes=True)
    loop = AgentLoop(engine, tok, {}, MultiTurnConfig(enable=True, max_user_turns=2),
                     interactions={"user": lambda response, *, sample, turn: "go on"})
    # Many stop tokens: turns end after a few tokens, so each trajectory has three turns.
    sp = SamplingParams(n=2, max_tokens=60, seed=0, stop_token_ids=list(range(3, len(tok), 3)))
    out = loop.generate_sequences(prompt_batch(tok, ["Q: 2+2\n", "Q: 7+1\n"], ["4", "8"], sp))
    assert list(out.non_tensor_batch["user_turns"]) == [2] * 4
    for i in range(len(out)):
        n = int(out.batch["prompt_lens"][i] + out.batch["response_lens"][i])
        want = oracle_routes(model, out.batch["input_ids"][i, :n].tolist(), 2)
        assert torch.equal(out.batch["routed_experts"][i, :n - 1].long(), want[:-1])
