"""Choosing an engine by name, a user's class and its output adapted or refused, and the
train / validation sampling built from the config."""
from __future__ import annotations

import textwrap

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.protocol import DataProto
from megarl.rollout.base import BaseRollout, Completion, SamplingParams
from megarl.rollout.config import RolloutConfig, SamplingConfig
from megarl.rollout.custom import CustomRollout, completions_from_batch
from megarl.rollout.registry import build_rollout
from megarl.rollout.sampling import train_sampling, val_sampling
from tests.rollout.fixtures import save_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model"))
    save_model(path, seed=0)
    return path


@pytest.mark.parametrize("name", ["sglang"])
def test_not_integrated_engines_are_refused_with_the_alternatives(model_dir, name):
    with pytest.raises(ConfigError, match=f"rollout.name: {name} is not integrated in megarl; use rollout.name=native"):
        build_rollout(RolloutConfig(name=name), model_dir)


def test_unknown_engine_name_suggests_the_closest(model_dir):
    with pytest.raises(ConfigError, match="did you mean 'native'"):
        build_rollout(RolloutConfig(name="nativ"), model_dir)


def test_engine_kwargs_reach_the_native_engine(model_dir):
    cfg = RolloutConfig(load_format="auto", engine_kwargs={"native": {"max_num_seqs": 3, "sleep_level": 2}})
    engine = build_rollout(cfg, model_dir)
    assert engine.max_num_seqs == 3 and engine.sleep_level == 2
    with pytest.raises(ConfigError, match=r"engine_kwargs\.native\.max_num_seq: .*did you mean 'max_num_seqs'"):
        build_rollout(RolloutConfig(engine_kwargs={"native": {"max_num_seq": 3}}), model_dir)


def test_hf_engine_refuses_tensor_parallelism(model_dir):
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=1"):
        build_rollout(RolloutConfig(name="hf", tensor_model_parallel_size=2), model_dir)


def test_trtllm_missing_package_names_it(model_dir):
    pytest.importorskip("torch")
    try:
        import tensorrt_llm  # noqa: F401
        pytest.skip("tensorrt_llm imports here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="needs the tensorrt_llm package .* rollout.name=native"):
        build_rollout(RolloutConfig(name="trtllm"), model_dir)


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "user_rollout.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_custom_class_errors(tmp_path, model_dir):
    def cfg(path, name):
        return RolloutConfig(name="custom", custom_cls_path=path, custom_cls_name=name)
    with pytest.raises(ConfigError, match="custom_cls_path: .*missing.py does not exist"):
        build_rollout(cfg(str(tmp_path / "missing.py"), "X"), model_dir)
    path = _write(tmp_path, """
        from megarl.rollout.base import BaseRollout
        class NotARollout:
            pass
        class Lazy(BaseRollout):
            pass
        """)
    with pytest.raises(ConfigError, match=r"has no class 'Missing' \(classes there: Lazy, NotARollout\)"):
        build_rollout(cfg(path, "Missing"), model_dir)
    with pytest.raises(ConfigError, match="must subclass megarl.rollout.base.BaseRollout"):
        build_rollout(cfg(path, "NotARollout"), model_dir)
    with pytest.raises(ConfigError, match="overrides neither generate"):
        build_rollout(cfg(path, "Lazy"), model_dir)
    with pytest.raises(ConfigError, match="custom_cls_path: cannot import 'no.such.module'"):
        build_rollout(cfg("no.such.module", "X"), model_dir)
    with pytest.raises(ConfigError, match="needs custom_cls_path"):
        RolloutConfig(name="custom")


class _Fixed(BaseRollout):
    """Returns whatever the test put in `out` (seed-000 style)."""

    def __init__(self, out):
        super().__init__(None)
        self.out = out

    def generate_sequences(self, batch):
        return self.out(batch)


def test_seed_style_class_is_adapted_into_protocol_fields():
    sp = SamplingParams(n=2, max_tokens=4, stop_token_ids=[9])

    def out(batch):
        o = batch.repeat(2, interleave=True)
        o.responses = [[5, 9], [6, 7, 8, 1], [4], [3, 3, 9]]
        o.log_probs = torch.tensor([[-1.0, -2.0, 0, 0], [-1, -1, -1, -1], [-3, 0, 0, 0], [-1, -2, -3, 0]])
        return o
    engine = CustomRollout(_Fixed(out), pad_token_id=0)
    batch = DataProto(non_tensor_batch={"prompt_token_ids": [[1, 2], [3]], "uid": ["a", "b"]},
                      meta_info={"sampling": sp})
    packed = engine.generate_sequences(batch)
    assert packed.batch["responses"].tolist() == [[5, 9, 0, 0], [6, 7, 8, 1], [4, 0, 0, 0], [3, 3, 9, 0]]
    assert packed.batch["response_mask"].sum(-1).tolist() == [2, 4, 1, 3]
    assert packed.batch["rollout_log_probs"][0].tolist() == [-1.0, -2.0, 0.0, 0.0]
    assert packed.batch["input_ids"][3].tolist() == [3, 3, 3, 9, 0, 0]   # width: 2 + 4
    assert list(packed.non_tensor_batch["finish_reasons"]) == ["stop", "length", "stop", "stop"]
    assert list(packed.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    groups = engine.generate([[1, 2], [3]], sp)
    assert groups[1][1] == Completion([3, 3, 9], [-1.0, -2.0, -3.0], "stop")


def test_mismatched_user_output_is_refused_clearly():
    sp = SamplingParams(n=2, max_tokens=4)
    prompts = [[1, 2], [3]]

    def batch_with(responses, log_probs, rows=4):
        b = DataProto(non_tensor_batch={"prompt_token_ids": [[0]] * rows})
        b.responses = responses
        b.log_probs = log_probs
        return b
    with pytest.raises(ValueError, match=r"2 responses for 2 prompts x n=2; return n responses per prompt"):
        completions_from_batch(batch_with([[1], [2]], [[-1.0], [-1.0]], rows=2), 2, sp)
    with pytest.raises(ValueError, match="response 1 has 2 tokens but 1 log_probs"):
        completions_from_batch(batch_with([[1], [2, 3], [4], [5]], [[-1.0], [-1.0], [-1.0], [-1.0]]), 2, sp)
    with pytest.raises(ValueError, match="response 0 has 1 tokens but non-zero log_probs past them"):
        completions_from_batch(batch_with([[1], [2], [4], [5]], torch.full((4, 3), -1.0)), 2, sp)
    with pytest.raises(ValueError, match="response 2 has 3 tokens but only 2 log_probs"):
        lp = torch.tensor([[-1.0, 0], [-1, 0], [-1, -1], [-1, 0]])
        completions_from_batch(batch_with([[1], [2], [4, 5, 6], [5]], lp), 2, sp)
    with pytest.raises(ValueError, match="responses are strings but no tokenizer"):
        completions_from_batch(batch_with(["a", "b", "c", "d"], [[-1.0]] * 4), 2, sp)
    no_logp = DataProto(non_tensor_batch={"prompt_token_ids": [[0]] * 4})
    no_logp.responses = [[1]] * 4
    with pytest.raises(ValueError, match="no `log_probs`"):
        completions_from_batch(no_logp, 2, sp)

    class TokenLevel(BaseRollout):
        def generate(self, prompts, sampling):
            return [[Completion([1, 2], [-1.0], "stop")] * sampling.n for _ in prompts]
    with pytest.raises(ValueError, match="2 tokens but 1 log_probs"):
        CustomRollout(TokenLevel()).generate(prompts, sp)


def test_user_class_without_weight_updates_refuses_them():
    class Frozen(BaseRollout):
        def generate(self, prompts, sampling):
            return [[Completion([1], [-0.5], "length")] * sampling.n for _ in prompts]
    engine = CustomRollout(Frozen())
    assert engine.generate([[1]], SamplingParams(n=2, max_tokens=1))[0][1].token_ids == [1]
    with pytest.raises(NotImplementedError, match="cannot take new weights"):
        engine.update_weights([("w", torch.zeros(1))])


def test_train_and_validation_sampling_from_config():
    cfg = RolloutConfig(temperature=0.9, top_p=0.95, top_k=40, n=5, response_length=64, seed=3,
                        stop_token_ids=[7], repetition_penalty=1.1,
                        val_kwargs=SamplingConfig(temperature=0.0, n=1, do_sample=False))
    train = train_sampling(cfg, eos_token_ids=[2])
    assert (train.temperature, train.top_p, train.top_k, train.n, train.max_tokens) == (0.9, 0.95, 40, 5, 64)
    assert train.stop_ids == {2, 7} and train.seed == 3 and train.repetition_penalty == 1.1 and not train.greedy
    val = val_sampling(cfg, eos_token_ids=[2])
    assert val.greedy and val.n == 1 and val.max_tokens == 64 and val.stop_ids == {2, 7}
    assert train_sampling(RolloutConfig(response_length=8, ignore_eos=True), [2]).stop_ids == set()
    with pytest.raises(ValueError, match="response_length is unset"):
        train_sampling(RolloutConfig())
    with pytest.raises(ConfigError, match="val_kwargs.top_p"):
        from megarl.config.typed import build
        build(RolloutConfig, {"val_kwargs": {"top_p": 0}})
