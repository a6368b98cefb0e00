"""The engine cost model (megarl/rollout/cost_model.py) on the real built-in engine: the same tokens
and log-probs as the engine unpaced, at least the modelled wall time per call and at every chunk
boundary of a pausable call, and bad values refused in one line.

    python -m pytest -q tests/test_cost_model.py
"""
from __future__ import annotations

import time

import pytest
import torch

from megarl.config import ConfigError
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.cost_model import CostModelConfig, describe
from megarl.rollout.registry import build_rollout

STEP_S = 0.15          # a decode step of the model under test: far above the tiny model's own CPU step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("paced") / "qwen2"), "qwen2", seed=3, vocab_size=301,
                        tokenizer=False)


def _engine(path: str, **cost):
    from transformers import AutoModelForCausalLM
    cfg = RolloutConfig(name="native", dtype="float32", cost_model=CostModelConfig(**cost))
    engine = build_rollout(cfg, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine.update_weights(model.state_dict().items())
    engine.finalize_weights()
    return engine


def test_paced_engine_generates_what_the_engine_does_in_at_least_the_modelled_time(tiny):
    plain = _engine(tiny)
    paced = _engine(tiny, enable=True, decode_s=STEP_S / 4, decode_row_s=0.0, prefill_token_s=1e-3, scale=4.0)
    prompts, sp = [[5, 17, 42, 8], [3, 3, 9]], SamplingParams(temperature=1.0, n=3, max_tokens=8, seed=11,
                                                               ignore_eos=True)
    want = plain.generate(prompts, sp)
    paced.generate(prompts, sp)                     # warm-up: the first call's set-up is no decode step
    start = time.perf_counter()
    got = paced.generate(prompts, sp)
    wall = time.perf_counter() - start
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    assert [[c.log_probs for c in g] for g in got] == [[c.log_probs for c in g] for g in want]
    steps = paced.stats["decode_steps"] // 2
    modelled = steps * STEP_S + 4 * 1e-3 * 7       # 7 prompt tokens, prefilled once for the n samples
    # what the call owed is the model's sum exactly (7 steps of 6 rows after the prefill's token,
    # 7 prompt tokens), and the wall time reached it
    assert steps == 7 and paced.stats["paced_owed_s"] == pytest.approx(modelled) and wall >= modelled


def test_rows_term_and_pausable_boundaries_wait_for_the_model(tiny):
    engine = _engine(tiny, enable=True, decode_s=0.0, decode_row_s=STEP_S / 4, prefill_token_s=0.0)
    sp = SamplingParams(temperature=1.0, n=4, max_tokens=9, seed=3, ignore_eos=True)
    seen: list[tuple[float, int, int]] = []
    start = time.perf_counter()

    def pause(unfinished: dict[int, int]) -> bool:
        seen.append((time.perf_counter() - start, engine.stats["decode_steps"], sum(unfinished.values())))
        return False

    engine.generate_pausable([[5, 17, 42, 8]], sp, pause, every=3)
    steps = [s for _, s, _ in seen]
    assert steps == [2, 5]                          # boundaries at 3 and 6 tokens (the prefill samples one)
    for elapsed, done, rows in seen:                # 4 rows run through every step (ignore_eos)
        assert rows == 4 and elapsed >= done * 4 * STEP_S / 4
    assert engine.stats["paced_owed_s"] == pytest.approx(engine.stats["decode_steps"] * STEP_S)


def test_cost_model_off_leaves_the_engine_untouched(tiny):
    engine = _engine(tiny)
    assert "generate" not in vars(engine) and "paced_s" not in engine.stats


def test_bad_cost_model_is_refused_in_one_line():
    from megarl.experiment import load_config
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", ["actor_rollout_ref.rollout.cost_model.scale=0"])
    assert "cost_model.scale" in str(err.value) and "\n" not in str(err.value)
    assert "x 100" in describe(CostModelConfig(enable=True, scale=100))


def test_charges_are_booked_per_kind(tiny):
    """The model's seconds split by kind: new prompts' prefill, continued responses' prefill, decode
    steps, and whole calls charged as a regeneration; the kinds sum to what each call owed, and
    PacedSeconds gives the split since its last reading (a step's metrics)."""
    from megarl.rollout.cost_model import PacedSeconds, charged_as
    c, step = 1e-3, 2e-3
    engine = _engine(tiny, enable=True, decode_s=step, decode_row_s=0.0, prefill_token_s=c, scale=1.0)
    ledger = PacedSeconds(engine)
    sp = SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=5, ignore_eos=True)
    steps0 = engine.stats["decode_steps"]
    # a new prompt of 3 tokens beside one of 4 whose two samples are continued from 3 and 1
    # response tokens: that prompt and those responses are prefilled again, 8 tokens
    engine.generate_pausable([[3, 3, 9], [5, 17, 42, 8]], sp, lambda unfinished: False, every=2,
                             prefixes=[[[], []], [[7, 9, 11], [13]]])
    steps = engine.stats["decode_steps"] - steps0
    got = ledger.since()
    assert got["paced_prefill_prompts"] == pytest.approx(3 * c)
    assert got["paced_prefill_continued"] == pytest.approx(8 * c)
    assert got["paced_decode"] == pytest.approx(steps * step) and steps > 0
    assert sum(got.values()) == pytest.approx(engine.stats["paced_owed_s"])
    with charged_as(engine, "regenerate"):
        engine.generate([[3, 3, 9]], sp)
    owed = engine.stats["paced_owed_s"]
    got = ledger.since()                            # only what came after the last reading
    assert got["paced_regenerate"] == pytest.approx(owed) and owed >= 3 * c
    assert got["paced_decode"] == got["paced_prefill_prompts"] == got["paced_prefill_continued"] == 0.0
    assert "pace_as" not in vars(engine)             # the kind ends with its block
