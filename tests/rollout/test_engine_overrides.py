"""actor_rollout_ref.model.override_config reaches the rollout engine's model, as it reaches the
trainer's; an engine that cannot take it is refused where the config is read.

    python -m pytest -q tests/rollout/test_engine_overrides.py

The parity check runs one real gloo rank: megatron-core's actor built with rms_norm_eps=0.5 over
the checkpoint's 1e-6, the built-in engine synced from it; transformers (the hf engine's model)
scores the same tokens with and without the override, so the check fails if either side drops it.
"""
from __future__ import annotations

import pytest
import torch

from megarl import engines
from megarl.config.errors import ConfigError
from megarl.engines import EngineInfo
from megarl.experiment import load_config
from megarl.launcher import preflight
from megarl.rollout.config import RolloutConfig
from megarl.rollout.registry import build_rollout
from tests.distributed import run_ranks
from tests.rollout.fixtures import PARITY_PROMPTS, PARITY_TEMPERATURE

EPS = {"model_config": {"rms_norm_eps": 0.5}}     # verl's spelling: override_config.model_config.<key>
OVERRIDE = "+actor_rollout_ref.model.override_config.model_config.rms_norm_eps=0.5"
KEY = "actor_rollout_ref.model.override_config"


def _score(model, batch) -> torch.Tensor:
    """log_softmax(logits / T) of each response token under a transformers model, row by row."""
    out = torch.zeros_like(batch.batch["rollout_log_probs"])
    for i, (ids, P, R) in enumerate(zip(batch.batch["input_ids"], batch.batch["prompt_lens"],
                                        batch.batch["response_lens"])):
        seq = ids[:P + R][None]
        logits = model(input_ids=seq).logits[0, P - 1:P + R - 1].float() / PARITY_TEMPERATURE
        out[i, :R] = torch.log_softmax(logits, -1).gather(-1, seq[0, P:P + R, None]).squeeze(-1)
    return out


def _parity(rank, world, path):
    from megarl.parallel import state
    from megarl.protocol import DataProto
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.hf_weights import buckets
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig

    state.init_distributed()
    actor = ActorWorker(ModelConfig(path=path, override_config=EPS), ActorConfig(
        ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, megatron=MegatronConfig(tensor_model_parallel_size=1)))
    native = build_rollout(RolloutConfig(), path, override_config=EPS)
    hf_with = build_rollout(RolloutConfig(name="hf"), path, override_config=EPS)
    hf_disk = build_rollout(RolloutConfig(name="hf"), path)                # config.json as it is on disk
    for engine in (native, hf_with, hf_disk):
        for bucket in buckets(actor.hf_tensors(), bucket_bytes=64 << 10):
            engine.update_weights(bucket)
        engine.finalize_weights()
    sp = SamplingParams(n=2, max_tokens=8, temperature=PARITY_TEMPERATURE, seed=0)
    batch = native.generate_sequences(DataProto(non_tensor_batch={"prompt_token_ids": PARITY_PROMPTS},
                                                meta_info={"sampling": sp}))
    trainer, _ = actor.compute_log_prob(batch, temperature=PARITY_TEMPERATURE, with_entropy=False)
    mask = batch.batch["response_mask"].bool()
    with torch.no_grad():
        gaps = {name: (trainer.cpu() - lp)[mask].abs().max().item() for name, lp in (
            ("native", batch.batch["rollout_log_probs"]), ("hf_with", _score(hf_with.model, batch)),
            ("hf_disk", _score(hf_disk.model, batch)))}
    eps = (native.args.rms_eps, hf_with.model.config.rms_norm_eps, hf_disk.model.config.rms_norm_eps)
    state.destroy_model_parallel()
    return gaps, eps


@pytest.mark.timeout(400)
def test_engine_log_probs_follow_the_override_as_the_trainers_do(tmp_path):
    from megarl.models.tiny import make_tiny_hf
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2", seed=1, vocab_size=301, rms_norm_eps=1e-6)
    [(gaps, eps)] = run_ranks(1, _parity, (path,))
    print("max |engine log-prob - megatron's| with rms_norm_eps=0.5:", gaps)
    assert eps == (0.5, 0.5, 1e-6)
    assert gaps["native"] <= 1e-5 and gaps["hf_with"] <= 1e-4, gaps
    assert gaps["hf_disk"] > 1e-2, f"the override does not change this model's log-probs: {gaps}"


# -- engines that cannot take it: refused at config time, in one line -----------------------------------------
def test_an_engine_that_cannot_take_overrides_is_refused_naming_it_and_the_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor_rollout_ref.rollout.name=trtllm", OVERRIDE,
                           "+actor_rollout_ref.model.override_config.model_config.rope_theta=1000"])
    text = str(err.value)
    assert text.startswith(f"{KEY}: sets rms_norm_eps, rope_theta, but the trtllm engine") and "\n" not in text
    assert "rollout.name=native" in text
    load_config(None, ["actor_rollout_ref.rollout.name=trtllm"])              # no override: nothing to refuse
    for name in ("native", "hf", "vllm"):
        assert engines.lookup(name).takes_hf_overrides, name


def test_the_refusal_reads_the_declaration_not_the_name():
    plain = EngineInfo(name="plain_eng", summary="a test engine", build="megarl.rollout.hf:build_hf")
    taking = EngineInfo(name="taking_eng", summary="a test engine", build="megarl.rollout.hf:build_hf",
                        takes_hf_overrides=True)
    for info in (plain, taking):
        engines.register(info)
    try:
        base = ["trainer.device=cpu", OVERRIDE]
        load_config(None, ["actor_rollout_ref.rollout.name=taking_eng", *base])
        with pytest.raises(ConfigError, match=f"{KEY}: sets rms_norm_eps, but the plain_eng engine"):
            load_config(None, ["actor_rollout_ref.rollout.name=plain_eng", *base])
        with pytest.raises(ConfigError, match=f"{KEY}: sets rms_norm_eps, but the plain_eng engine"):
            build_rollout(RolloutConfig(name="plain_eng"), "no-model", override_config=EPS)
    finally:
        for info in (plain, taking):
            engines.unregister(info.name)


def _user_class(tmp_path, declares: bool) -> list[str]:
    path = tmp_path / f"user_engine_{int(declares)}.py"
    path.write_text("from megarl.rollout.base import BaseRollout\n"
                    "class Engine(BaseRollout):\n"
                    f"    takes_hf_overrides = {declares}\n"
                    "    def __init__(self, config, role, hf_overrides=None):\n"
                    "        super().__init__(config, role)\n"
                    "        self.hf_overrides = hf_overrides\n"
                    "    def generate(self, prompts, sampling, prompt_limit=None):\n"
                    "        return []\n"
                    "    def update_weights(self, bucket):\n"
                    "        pass\n"
                    "    def finalize_weights(self):\n"
                    "        pass\n")
    return ["actor_rollout_ref.rollout.name=custom", f"actor_rollout_ref.rollout.custom_cls_path={path}",
            "actor_rollout_ref.rollout.custom_cls_name=Engine", "trainer.device=cpu", OVERRIDE]


def test_a_users_class_takes_them_only_when_it_declares_it(tmp_path):
    refused = load_config(None, _user_class(tmp_path, declares=False))
    with pytest.raises(ConfigError, match=f"{KEY}: sets rms_norm_eps, but the custom engine.*declare "
                                          "takes_hf_overrides = True on the class"):
        preflight.check_engine(refused)
    with pytest.raises(ConfigError, match=f"{KEY}: Engine: sets rms_norm_eps"):
        build_rollout(refused.rollout, "no-model", override_config=refused.model.override_config)
    taken = load_config(None, _user_class(tmp_path, declares=True))
    assert preflight.check_engine(taken).takes_hf_overrides
    engine = build_rollout(taken.rollout, "no-model", override_config=taken.model.override_config)
    assert engine.user.hf_overrides == {"rms_norm_eps": 0.5}


def test_vllm_takes_them_from_override_config_only():
    from megarl.rollout.vllm.args import check_config
    cfg = RolloutConfig(name="vllm", free_cache_engine=False, enable_sleep_mode=False,
                        engine_kwargs={"vllm": {"hf_overrides": {"rms_norm_eps": 0.5}}})
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.hf_overrides: is set by megarl from "
                                          r"actor_rollout_ref\.model\.override_config"):
        check_config(cfg)


def test_engine_kwargs_cannot_set_the_hf_engines_overrides():
    with pytest.raises(ConfigError, match=r"unknown option 'hf_overrides' for the hf engine"):
        build_rollout(RolloutConfig(name="hf", engine_kwargs={"hf": {"hf_overrides": {}}}), "no-model")


def test_a_mapping_merges_into_config_jsons_in_every_engine_that_takes_it(tmp_path):
    """rope_parameters {"rope_theta": 1234}: transformers 5's config.json keeps its rope_type, as the
    trainer's with_overrides keeps it (from_pretrained's keyword would replace the whole mapping)."""
    from megarl.models.tiny import make_tiny_hf
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2", seed=1, vocab_size=301)
    override = {"rope_parameters": {"rope_theta": 1234.0}}
    hf = build_rollout(RolloutConfig(name="hf"), path, override_config=override)
    assert hf.model.config.rope_parameters == {"rope_type": "default", "rope_theta": 1234.0}
    native = build_rollout(RolloutConfig(), path, override_config=override)
    assert (native.args.rope_theta, dict(native.args.rope_scaling)) == (1234.0, {"rope_type": "default"})
