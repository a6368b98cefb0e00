"""The rollout contract (megarl/rollout/base.py's RolloutEngine) is all an engine implements: an
engine with its three abstract methods alone trains, and one missing a method is refused when built.

    python -m pytest -q tests/rollout/test_contract.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megarl.protocol import DataProto
from megarl.rollout.base import Completion, RolloutEngine, SamplingParams, admit
from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Echo(RolloutEngine):
    """Answers each prompt with its own last token, at log-prob -0.5 (what is packed is checked)."""

    def generate(self, prompts, sampling, prompt_limit=None):
        prompts = admit(self, prompts, sampling, prompt_limit)
        return [[Completion([p[-1]], [-0.5], "length")] * sampling.n for p in prompts]

    def update_weights(self, bucket):
        pass

    def finalize_weights(self):
        pass


def prompt_batch(prompts, **sampling):
    ids = np.empty(len(prompts), dtype=object)
    for i, p in enumerate(prompts):
        ids[i] = list(p)
    return DataProto.from_dict(non_tensors={"prompt_token_ids": ids},
                               meta_info={"sampling": SamplingParams(**sampling), "pad_token_id": 0})


def test_an_engine_missing_a_method_is_refused_when_built():
    class Half(RolloutEngine):
        def generate(self, prompts, sampling, prompt_limit=None):
            return []

    with pytest.raises(TypeError) as err:
        Half()
    line = str(err.value)
    assert "\n" not in line and "Half" in line and "update_weights" in line and "finalize_weights" in line, line


def test_a_users_class_without_the_weight_methods_is_refused_when_built(tmp_path):
    """rollout.name=custom: BaseRollout's weight methods refuse, so a class leaving them out would
    fail at the trainer's first sync; it is refused in one line when built, before it is constructed."""
    from megarl.config.errors import ConfigError
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.registry import build_rollout
    path = tmp_path / "frozen.py"
    path.write_text("from megarl.rollout.base import BaseRollout\n"
                    "class Frozen(BaseRollout):\n"
                    "    def __init__(self, config, role):\n"
                    "        raise AssertionError('constructed')\n"
                    "    def generate(self, prompts, sampling, prompt_limit=None):\n"
                    "        return []\n"
                    "    def update_weights(self, bucket):\n"
                    "        pass\n")
    with pytest.raises(ConfigError) as err:
        build_rollout(RolloutConfig(name="custom", custom_cls_path=str(path), custom_cls_name="Frozen"), "no-model")
    line = str(err.value)
    assert "\n" not in line and line.startswith("actor_rollout_ref.rollout.custom_cls_name: Frozen does not "
                                                 "implement finalize_weights(): the trainer syncs"), line


def test_the_contract_gives_what_the_trainer_and_admit_use():
    engine = Echo()
    out = engine.generate_sequences(prompt_batch([[3, 4, 5], [6]], n=2, max_tokens=1))
    assert out.batch["responses"].tolist() == [[5], [5], [6], [6]]
    assert out.batch["input_ids"].tolist() == [[3, 4, 5, 5], [3, 4, 5, 5], [6, 6, 0, 0], [6, 6, 0, 0]]
    assert out.batch["rollout_log_probs"].tolist() == [[-0.5]] * 4
    assert list(out.non_tensor_batch["finish_reasons"]) == ["length"] * 4
    # admit()'s state: a default guard (no length limit), sleep and wake, a sync bookkeeping that starts ready
    assert engine.guard.max_length is None and not engine.asleep and engine.weights.state == "ready"
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams(max_tokens=1))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep: call wake"):
        engine.generate([[1]], SamplingParams(max_tokens=1))
    engine.wake()
    assert engine.generate([[1]], SamplingParams(max_tokens=1))[0][0].token_ids == [1]
    # the state is each engine's own, and an engine may replace it
    other = Echo()
    other.guard.apply([[1, 2]])
    assert other.guard is not engine.guard and other.weights is not engine.weights
    from megarl.rollout.prompts import PromptGuard
    other.guard = PromptGuard(max_length=2)
    with pytest.raises(ValueError, match="more than rollout.prompt_length=2"):
        other.generate_sequences(prompt_batch([[1, 2, 3]], max_tokens=1))


@pytest.mark.timeout(900)
def test_an_engine_written_from_the_contract_alone_trains(addition_model_dir, tmp_path):
    """tests/rollout/toy_engine.py implements only generate, update_weights and finalize_weights;
    one step of the quickstart on one CPU process runs through it, and the trainer's recomputed
    log-probs equal the engine's (it generated from the weights the trainer synced into it)."""
    from tests.rollout import toy_engine
    assert {m for m in vars(toy_engine.ToyEngine) if not m.startswith("_")} == \
        {"generate", "update_weights", "finalize_weights"}
    proc = train([f"actor_rollout_ref.model.path={addition_model_dir}", f"trainer.default_local_dir={tmp_path}",
                  "actor_rollout_ref.model.external_lib=tests.rollout.toy_engine",
                  "actor_rollout_ref.rollout.name=toy",
                  "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
                  "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                  "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                  "algorithm.filter_groups.enable=false"],
                 env={**os.environ, "PYTHONPATH": ROOT})
    code, out = finish(proc)
    assert code == 0, out[-3000:]
    records = read_metrics(str(tmp_path))
    step = next(r for r in records if r["step"] == 1)
    assert step["response_length/mean"] > 0 and torch.isfinite(torch.tensor(step["actor/pg_loss"]))
    assert step["rollout_corr/max_abs_log_prob_diff"] < 1e-3, step["rollout_corr/max_abs_log_prob_diff"]


def test_the_agent_loop_reports_its_engines_state():
    """AgentLoop implements the contract around an engine: admit()'s state is the wrapped engine's."""
    from megarl.examples.tool_use.model import build_tokenizer
    from megarl.rollout.multiturn import AgentLoop
    engine = Echo()
    loop = AgentLoop(engine, build_tokenizer(), {})
    assert loop.guard is engine.guard and loop.weights is engine.weights and not loop.asleep
    loop.sleep()
    assert engine.asleep and loop.asleep
    with pytest.raises(RuntimeError, match="asleep: call wake"):
        loop.generate_sequences(prompt_batch([[3, 4]], max_tokens=1))
    loop.wake()
    assert loop.generate_sequences(prompt_batch([[3, 4]], max_tokens=1)).batch["responses"].tolist() == [[4]]
